"""A real one-host cluster: the scheduler here, 1 prefill and 2 decode engine processes,
KV moving over NIXL (UCX on loopback/shared memory), a real store on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.cluster.launcher import LocalCluster
from dualpath.config import ClusterConfig, KVStoreConfig
from dualpath.protocol import RequestEvent
from dualpath.types import RequestScope
from tests.helpers import assert_same_tokens

pytest.importorskip("nixl_cu12")

BLOCK = 64
# Exact hit counts need the last turn's blocks written before the next turn is placed; however
# long that takes on a loaded machine, the next turn waits for it (the default gives up
# after 5 s and recomputes).
PERSIST_WAIT_S = 120.0
# For what must happen (a death noticed, a report arriving, processes exiting): waits end as
# soon as it has, so these only bound a real hang, however loaded the machine. An engine
# coming back loads its model again: more.
BUDGET_S = 60
RESTART_BUDGET_S = 120


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Out:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.logprobs = None


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cluster")
    with LocalCluster(
        ClusterConfig(
            num_prefill_nodes=1, num_decode_nodes=2, mode="dualpath", persist_wait_s=PERSIST_WAIT_S
        ),
        model_dir=tiny_model_dir,
        store=KVStoreConfig(root_dir=root / "kv"),
        log_dir=root / "logs",
    ) as local:
        yield local


def test_multi_turn_conversations_reuse_kv_and_match_the_single_node_engine(
    cluster: LocalCluster, tiny_model_dir: Path
) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    contexts = [random_ids(n, seed=n) for n in (1000, 1130, 1270)]
    hit_ratios: list[list[float]] = [[] for _ in contexts]
    expected_cached = [0 for _ in contexts]
    for turn in range(3):
        outputs = cluster.generate(contexts, params, timeout_s=120)
        with LLM(tiny_model_dir) as llm:  # full recompute, no store
            reference = llm.generate([{"prompt_token_ids": c} for c in contexts], params)
        for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
            assert out.error is None and out.finish_reason == "length"
            assert_same_tokens(ref, _Out(out.token_ids), label=f"conversation {i} turn {turn}")
            assert out.num_cached_tokens == expected_cached[i]
            hit_ratios[i].append(out.num_cached_tokens / len(contexts[i]))
            # What the DE persisted: every full block of prompt + output but the last token.
            expected_cached[i] = BLOCK * ((len(contexts[i]) + len(out.token_ids) - 1) // BLOCK)
            contexts[i] = contexts[i] + out.token_ids + random_ids(20, seed=100 * turn + i)
    for ratios in hit_ratios:
        assert ratios[0] == 0.0
        assert min(ratios[1:]) >= 0.9, ratios
    # Both read paths carried hit KV: the DEs read some of it from their own nodes' SNICs.
    link_bytes = cluster.coordinator.link_bytes()
    decode_reads = sum(link_bytes[e]["store_read_bytes"] for e in (1, 2))
    assert decode_reads > 0


def test_seeded_sampling_gives_the_single_node_engines_tokens(
    cluster: LocalCluster, tiny_model_dir: Path
) -> None:
    # The PE samples the first token and a DE the rest; each token's draw depends only on the
    # seed and its index, so the split changes nothing.
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5)
    prompts = [random_ids(300, seed=s) for s in (31, 32)]
    outputs = cluster.generate(prompts, params, timeout_s=120)
    with LLM(tiny_model_dir) as llm:
        reference = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]


def test_idle_engines_only_keep_alive_and_requests_still_place_at_once(
    cluster: LocalCluster,
) -> None:
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    cluster.generate([random_ids(100, seed=7)], params, timeout_s=60)
    # Three engines at 10 ms would send ~300 a second; idle, each keeps alive every 0.25 s.
    # The engines settle first (last writes, last changed reports), however long that takes:
    # a second with few reports must come, and never does if they report on regardless.
    deadline_s = time.monotonic() + BUDGET_S
    while True:
        before = cluster.coordinator.num_reports
        time.sleep(1.0)
        num_reports = cluster.coordinator.num_reports - before
        if num_reports <= 20:
            break
        assert time.monotonic() < deadline_s, f"{num_reports} reports in the last second"
    (out,) = cluster.generate([random_ids(100, seed=8)], params, timeout_s=60)
    assert out.error is None and len(out.token_ids) == 2


def test_cache_salts_keep_tenants_apart_in_the_store(cluster: LocalCluster) -> None:
    """Salt A's prompt is persisted; the same prompt under salt B or unsalted finds none of
    it, salt A finds all of it (its blocks keyed in its namespace by the scheduler's lookup,
    the PE's and DE's reads and the DE's writes alike); greedy tokens are the same whatever
    the salt."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = random_ids(300, seed=41)

    def run(cache_salt: str | None):
        scope = RequestScope(cache_salt=cache_salt)
        out = cluster.result(cluster.submit(prompt, params, scope=scope), timeout_s=120)
        assert out.error is None
        return out

    runs = [run(salt) for salt in ("tenant-a", "tenant-b", "tenant-a", "tenant-b", None)]
    full_hit = BLOCK * ((len(prompt) - 1) // BLOCK)  # all of the prompt but its last token
    assert [out.num_cached_tokens for out in runs] == [0, 0, full_hit, full_hit, 0]
    for out, label in zip(runs[1:], ("B", "A again", "B again", "unsalted"), strict=True):
        assert_same_tokens(_Out(runs[0].token_ids), _Out(out.token_ids), label=label)


def test_bad_requests_are_refused_before_reaching_an_engine(cluster: LocalCluster) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context"):
        cluster.submit([1] * 16000, SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="empty"):
        cluster.submit([], SamplingParams())


def test_engines_exit_when_the_launcher_is_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from dualpath.cluster.launcher import LocalCluster\n"
        "from dualpath.config import ClusterConfig, KVStoreConfig\n"
        f"c = LocalCluster(ClusterConfig(heartbeat_timeout_s=2.0), model_dir=Path({str(tiny_model_dir)!r}),"
        " store=KVStoreConfig(root_dir=None)).start()\n"
        "print(' '.join(map(str, c.engine_pids)), flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in launcher.stdout.readline().split()]
    assert len(pids) == 3
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + BUDGET_S
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _is_running(p)]
    assert alive == [], f"engine processes {alive} outlived the killed launcher"


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie whose parent died is reaped by init; treat a zombie as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def _fast_failing_1p2d(tiny_model_dir: Path, tmp_path: Path) -> LocalCluster:
    """1P2D with a 2 s heartbeat timeout, for the engine-loss tests."""
    return LocalCluster(
        ClusterConfig(num_prefill_nodes=1, num_decode_nodes=2, heartbeat_timeout_s=2.0),
        model_dir=tiny_model_dir,
        store=KVStoreConfig(root_dir=tmp_path / "kv"),
        log_dir=tmp_path / "logs",
    )


def test_streaming_requests_go_on_with_the_same_tokens_when_their_decode_engine_dies(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=160, ignore_eos=True, logprobs=2)
    prompts = [random_ids(300, seed=s) for s in range(6)]
    tokens: dict[int, list[int]] = {}
    tops: dict[int, list] = {}  # per token: its top-2 (id, logprob), for assert_same_tokens
    finished: dict[int, RequestEvent] = {}

    def on_event(event: RequestEvent) -> None:
        tokens.setdefault(event.request_id, []).extend(event.token_ids)
        tops.setdefault(event.request_id, []).extend(
            SimpleNamespace(top=top) for _, top in event.logprobs or ()
        )
        if event.finish_reason is not None:
            finished[event.request_id] = event

    with _fast_failing_1p2d(tiny_model_dir, tmp_path) as cluster:
        request_ids = [cluster.submit(p, params, on_event=on_event) for p in prompts]
        deadline_s = time.monotonic() + 60
        # Kill decode engine 2 while a request on it is streaming.
        while not any(
            (cluster.coordinator.placement(r) or (0, 0))[1] == 2 and len(tokens.get(r, ())) >= 8
            for r in request_ids
        ):
            assert time.monotonic() < deadline_s, "no request streamed from decode engine 2"
            time.sleep(0.001)
        os.kill(cluster.engine_pids[2], signal.SIGKILL)
        while len(finished) < len(request_ids):
            assert time.monotonic() < deadline_s + 60, f"{len(finished)} of 6 finished"
            time.sleep(0.01)
        assert [finished[r].error for r in request_ids] == [None] * len(prompts)
        snapshot = cluster.snapshot()
        assert snapshot.num_replaced >= 1 and snapshot.num_replacement_delays >= 1
        # The same prompts again, undisturbed, on the engines left.
        again = cluster.generate(prompts, params, timeout_s=120)
    for i, (undisturbed, r) in enumerate(zip(again, request_ids, strict=True)):
        assert len(tokens[r]) == len(tops[r]) == 160  # each token once: none repeated, none lost
        streamed = SimpleNamespace(token_ids=tokens[r], logprobs=tops[r])
        assert_same_tokens(streamed, undisturbed, label=f"request {i}")


def _restarting(
    tiny_model_dir: Path,
    tmp_path: Path,
    *,
    num_decode_nodes: int,
    heartbeat_timeout_s: float = 2.0,
) -> LocalCluster:
    """1P-N-D (a 2 s heartbeat timeout unless told) that starts an engine that died again."""
    return LocalCluster(
        ClusterConfig(
            num_prefill_nodes=1,
            num_decode_nodes=num_decode_nodes,
            heartbeat_timeout_s=heartbeat_timeout_s,
        ),
        model_dir=tiny_model_dir,
        store=KVStoreConfig(root_dir=tmp_path / "kv"),
        log_dir=tmp_path / "logs",
        restart_engines=True,
    )


def test_a_dead_engine_is_restarted_and_rejoins_the_running_scheduler(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with _restarting(tiny_model_dir, tmp_path, num_decode_nodes=2) as cluster:
        victim = cluster.engine_pids[2]
        kill_s = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while 2 not in cluster.snapshot().dead_engines:
            assert time.monotonic() - kill_s < BUDGET_S, "the death was not noticed"
            time.sleep(0.01)
        while not cluster.snapshot().is_ready:
            assert time.monotonic() - kill_s < RESTART_BUDGET_S, "engine 2 did not come back"
            time.sleep(0.05)
        print(f"\nengine 2 back {time.monotonic() - kill_s:.1f} s after the kill")
        snapshot = cluster.snapshot()
        assert snapshot.engine_restarts == {2: 1} and snapshot.dead_engines == {}
        assert snapshot.num_live_engines_by_role == {"prefill": 1, "decode": 2}  # counted once
        assert cluster.engine_pids[2] != victim and not _is_running(victim)
        # The new engine gets work: requests land on both decode engines again.
        outputs = cluster.generate([random_ids(200, seed=s) for s in range(8)], params)
        assert [o.error for o in outputs] == [None] * 8
        assert cluster.coordinator.link_bytes()[2].get("busy_us", 0) > 0


def test_an_engine_declared_dead_while_alive_leaves_and_rejoins_afresh(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A decode engine stalled past the heartbeat timeout (SIGSTOP: a long pause, not an
    exit) is declared dead and its requests go elsewhere. When it runs again it must not
    serve on from its stale state: the scheduler no longer knows it, so it exits
    (EXIT_SCHEDULER_LOST) and is started again, rejoining under its id."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with _restarting(tiny_model_dir, tmp_path, num_decode_nodes=2) as cluster:
        stalled = cluster.engine_pids[2]
        os.kill(stalled, signal.SIGSTOP)
        stall_s = time.monotonic()
        try:
            while 2 not in cluster.snapshot().dead_engines:
                assert time.monotonic() - stall_s < BUDGET_S, "the stall was not noticed"
                time.sleep(0.05)
        finally:
            os.kill(stalled, signal.SIGCONT)
        while not cluster.snapshot().is_ready:
            assert time.monotonic() - stall_s < RESTART_BUDGET_S, "engine 2 did not come back"
            time.sleep(0.05)
        snapshot = cluster.snapshot()
        assert snapshot.engine_restarts == {2: 1} and snapshot.dead_engines == {}
        assert cluster.engine_pids[2] != stalled and not _is_running(stalled)
        outputs = cluster.generate([random_ids(200, seed=s) for s in range(8)], params)
        assert [o.error for o in outputs] == [None] * 8


def test_without_a_prefill_engine_requests_fail_at_once_until_it_is_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # Silence is not how the loss is found: with a heartbeat timeout far beyond the budget, a
    # loss seen within it was seen by the exit, "at once", however slow the machine.
    with _restarting(
        tiny_model_dir, tmp_path, num_decode_nodes=1, heartbeat_timeout_s=600.0
    ) as cluster:
        kill_s = time.monotonic()
        os.kill(cluster.engine_pids[0], signal.SIGKILL)
        while cluster.snapshot().unavailable_reason is None:
            assert time.monotonic() - kill_s < BUDGET_S, "the loss of the only PE was not seen"
            time.sleep(0.01)
        assert "exited" in cluster.snapshot().dead_engines[0]
        # Failed, not queued until the PE is back (a restart loads the model: seconds).
        (failed,) = cluster.generate([random_ids(100, seed=1)], params, timeout_s=BUDGET_S)
        assert failed.error == "no prefill engine is alive"
        while not cluster.snapshot().is_ready:  # restarted: the server recovers on its own
            assert time.monotonic() - kill_s < RESTART_BUDGET_S, "the PE did not come back"
            time.sleep(0.05)
        (served,) = cluster.generate([random_ids(100, seed=1)], params, timeout_s=60)
        assert served.error is None and len(served.token_ids) == 4
        assert cluster.snapshot().engine_restarts == {0: 1}


def test_requests_without_output_survive_the_loss_of_their_decode_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [random_ids(1500, seed=20 + s) for s in range(6)]
    with _fast_failing_1p2d(tiny_model_dir, tmp_path) as cluster:
        request_ids = [cluster.submit(p, params) for p in prompts]
        deadline_s = time.monotonic() + 30
        while not any((cluster.coordinator.placement(r) or (0, 0))[1] == 2 for r in request_ids):
            assert time.monotonic() < deadline_s, "nothing was placed on decode engine 2"
            time.sleep(0.001)
        os.kill(cluster.engine_pids[2], signal.SIGKILL)  # placed there, no token out yet
        outcomes = [cluster.result(r, timeout_s=90) for r in request_ids]
        assert [o.error for o in outcomes] == [None] * len(prompts)
        assert cluster.coordinator.num_replaced >= 1, "no request was on the killed engine"
        # The same tokens as the survivors make for the same prompts now.
        again = cluster.generate(prompts, params)
    for i, (first, second) in enumerate(zip(again, outcomes, strict=True)):
        assert_same_tokens(first, second, label=f"request {i}")


def test_the_shared_memory_transport_serves_a_conversation(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    context = random_ids(400, seed=11)
    with LocalCluster(
        ClusterConfig(
            num_prefill_nodes=1, num_decode_nodes=1, mode="dualpath", persist_wait_s=PERSIST_WAIT_S
        ),
        model_dir=tiny_model_dir,
        store=KVStoreConfig(root_dir=tmp_path / "kv"),
        transport="shm",
        log_dir=tmp_path / "logs",
    ) as cluster:
        first = cluster.generate([context], params, timeout_s=120)[0]
        second_prompt = context + first.token_ids + random_ids(30, seed=12)
        second = cluster.generate([second_prompt], params, timeout_s=120)[0]
    with LLM(tiny_model_dir) as llm:
        reference = llm.generate([{"prompt_token_ids": second_prompt}], params)[0]
    assert first.error is None and second.error is None
    assert second.num_cached_tokens == BLOCK * ((len(context) + len(first.token_ids) - 1) // BLOCK)
    assert_same_tokens(reference, _Out(second.token_ids), label="shm transport, turn 2")


def test_a_turn_sent_at_once_still_hits_the_blocks_being_written(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An agent's next turn arrives while the DE is still writing the last turn's blocks
    through a slow SNIC (0.004 Gbps: ~0.25 s a block): it waits for them, no recompute."""
    from dualpath.config import TrafficConfig

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # 10 blocks: ~2.5 s of writes from when the DE got them, while the next turn is sent as
    # soon as this one ends (4 tokens later); a wait that long is allowed for.
    context = random_ids(640, seed=21)
    with LocalCluster(
        ClusterConfig(
            num_prefill_nodes=1,
            num_decode_nodes=1,
            mode="dualpath",
            traffic=TrafficConfig(snic_bandwidth_gbps=0.004),
            persist_wait_s=PERSIST_WAIT_S,
        ),
        model_dir=tiny_model_dir,
        store=KVStoreConfig(root_dir=tmp_path / "kv"),
        log_dir=tmp_path / "logs",
    ) as cluster:
        first = cluster.generate([context], params, timeout_s=120)[0]
        second_prompt = context + first.token_ids + random_ids(30, seed=22)
        second = cluster.generate([second_prompt], params, timeout_s=120)[0]
        num_waits = cluster.coordinator.persisting.num_waits
    assert first.error is None and second.error is None
    assert second.num_cached_tokens == BLOCK * ((len(context) + len(first.token_ids) - 1) // BLOCK)
    assert num_waits >= 1


def test_an_mla_model_serves_a_conversation_reading_through_both_sides(
    tiny_deepseek_dir: Path, tmp_path: Path
) -> None:
    """DeepSeek-V3.2's latent entries (indexer keys with them) between engine processes over
    NIXL: split reads put each hit on both sides, and the tokens are the single-node engine's;
    the sides read exactly the cached tokens' entries (4 layers x 320 B a token)."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    contexts = [random_ids(n, seed=n) for n in (300, 200)]
    with LocalCluster(
        ClusterConfig(
            num_prefill_nodes=1,
            num_decode_nodes=1,
            read_path="split",
            persist_wait_s=PERSIST_WAIT_S,
        ),
        model_dir=tiny_deepseek_dir,
        store=KVStoreConfig(root_dir=tmp_path / "kv"),
        log_dir=tmp_path / "logs",
    ) as cluster:
        first = cluster.generate(contexts, params, timeout_s=120)
        prompts = [
            c + o.token_ids + random_ids(40, seed=5) for c, o in zip(contexts, first, strict=True)
        ]
        second = cluster.generate(prompts, params, timeout_s=120)
        expected_bytes = sum(o.num_cached_tokens for o in second) * 4 * 320
        deadline_s = time.monotonic() + BUDGET_S
        while True:  # the engines' reports carry their read counters
            links = cluster.coordinator.link_bytes()
            read_bytes = [links[e].get("store_read_bytes", 0) for e in (0, 1)]
            if sum(read_bytes) >= expected_bytes or time.monotonic() > deadline_s:
                break
            time.sleep(0.05)
    with LLM(tiny_deepseek_dir) as llm:
        expected = llm.generate([{"prompt_token_ids": p} for p in contexts + prompts], params)
    assert [o.error for o in first + second] == [None] * 4
    for got, want in zip(first + second, expected, strict=True):
        assert got.token_ids == list(want.token_ids)
    assert expected_bytes > 0 and all(n > 0 for n in read_bytes), read_bytes
    assert sum(read_bytes) == expected_bytes
