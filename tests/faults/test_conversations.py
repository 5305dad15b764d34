"""32 multi-turn conversations from the agentic trace while engines fail mid-run.

* One host, `dualpath serve` (2P2D, engines restarted when they die): a decode engine, then a
  prefill engine, is SIGKILLed.
* The multi-host cluster on GlusterFS (2P2D, each engine on its host under `dualpath engine`,
  which starts it again when it dies or loses the scheduler): a decode host is cut off and
  comes back, then a prefill engine and a decode engine are SIGKILLed.

Each fault strikes while the engine holds requests, seen on the server's /metrics
(``strike.py``: it is sure to hit one), never after a fixed time. Expected in each: no request
lost, no client-visible error, every conversation's tokens those of an undisturbed run
(greedy), the engine back in /health on its own; the time from the fault to the first
re-placed token is measured and printed.

Then, in both, SIGTERM reaches the server in the middle of a fault (a decode engine SIGKILLed
while it holds requests, the server SIGTERMed once /health counts the death: its requests are
being placed again): it exits with 0, no engine process is left (engines stop when the server
tells them; a remote one whose restart had not rejoined when the server left is stopped by
SIGTERM, exit 0), no store write is left half-done, and a new server on the same store gives
the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dualpath.bench.agents import TurnRecord, run_agents
from dualpath.kv.block_file import is_temp_name
from dualpath.workload.mooncake import load_mooncake_trace, packaged_trace_path
from dualpath.workload.shape import cap_turns, scale_generations
from tests.faults.cluster import MultiHostCluster
from tests.faults.strike import Cut, Fault, Kill, snapshot_after_now, strike_while_holding
from tests.server.serving import API_KEY, MODEL, engine_pids, is_running, start_server

pytest.importorskip("nixl_cu12")

NUM_CONVERSATIONS = 32
NUM_TURNS = 3
# A decode engine fails once this many turns have finished (and it holds requests): mid-run,
# with most first turns still in flight. A prefill engine fails as soon as it holds requests
# it has not prefilled, while the first turns queue for prefill.
FAIL_DECODE_AFTER_TURNS = NUM_CONVERSATIONS // 8
HEARTBEAT_TIMEOUT_S = 4.0  # the multi-host cluster's remote engines
# Hang guards, far above a loaded 2-core machine's times: each wait ends on what it waits for.
BACK_TIMEOUT_S = 300.0  # a restarted engine in /health (a cut-off one backs off up to 30 s)
EXIT_TIMEOUT_S = 120.0  # a server or `dualpath engine` told to stop
# A replay in which the fault found no request to strike is run again, at most this often. On
# a warm server a decode engine holds each request for milliseconds, and a replay (a second or
# two) can end before a scrape sees it holding one: four replays in a row once missed engine 3.
MAX_REPLAYS = 10


@dataclass(frozen=True)
class Target:
    """A serving cluster as the conversations and the checks see it."""

    url: str
    model: str
    api_key: str | None
    health: Callable[[], dict]
    metric: Callable[[str], float]
    num_engines: int


def conversations(model_dir: Path):
    """The trace's first 32 sessions, shaped for the tiny model on a small host: contexts at 1%
    of their length (a few hundred tokens, growing), 3 turns, a fifth of each answer."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = load_mooncake_trace(
        packaged_trace_path("agentic_coding_dev"),
        vocab_size=vocab_size,
        max_sessions=NUM_CONVERSATIONS,
        length_scale=0.01,
    )
    return scale_generations(cap_turns(workload, NUM_TURNS), 0.2).sessions


def replay(target: Target, sessions, on_turn=None) -> dict[tuple[int, int], TurnRecord]:
    records = asyncio.run(
        run_agents(
            target.url,
            target.model,
            sessions,
            api_key=target.api_key,
            timeout_s=300,
            on_turn=on_turn,
        )
    )
    return {(r.session, r.turn): r for r in records}


def undisturbed(target: Target, sessions) -> dict[tuple[int, int], TurnRecord]:
    reference = replay(target, sessions)
    assert len(reference) == NUM_CONVERSATIONS * NUM_TURNS
    assert all(r.error is None for r in reference.values())
    return reference


class FaultWatch:
    """``watch`` on a thread beside a replay; ``stop`` once the replay has ended, which
    re-raises what ``watch`` raised."""

    def __init__(self, watch: Callable[[threading.Event], None]) -> None:
        self.has_ended = threading.Event()  # the replay
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(watch,), daemon=True)
        self._thread.start()

    def _run(self, watch: Callable[[threading.Event], None]) -> None:
        try:
            watch(self.has_ended)
        except BaseException as exc:  # re-raised on the test's thread
            self._error = exc

    def stop(self) -> None:
        self.has_ended.set()
        self._thread.join()
        if self._error is not None:
            raise self._error


def replay_until_struck(
    target: Target,
    sessions,
    strike: Callable[[list[TurnRecord], threading.Event], bool],
    on_records: Callable[[dict[tuple[int, int], TurnRecord]], None] = lambda _: None,
) -> None:
    """Replay ``sessions`` with ``strike(done, has_ended)`` watching beside it (True once its
    fault struck), and again while it has not: a replay can end before the engine is seen
    holding a request (warm-cache turns leave a decode engine holding few, briefly), and a
    fault test must not pass or fail by that. ``on_records`` checks each replay's records."""
    for _ in range(MAX_REPLAYS):
        done: list[TurnRecord] = []
        has_struck = threading.Event()

        def watch(has_ended: threading.Event, done=done, has_struck=has_struck) -> None:
            if strike(done, has_ended):
                has_struck.set()

        watcher = FaultWatch(watch)
        try:
            records = replay(target, sessions, done.append)
        finally:
            watcher.stop()
        on_records(records)
        if has_struck.is_set():
            return
    raise AssertionError(f"the fault found no request to strike in {MAX_REPLAYS} replays")


def replay_through_fault(
    target: Target,
    sessions,
    reference,
    engine_id: int,
    fault: Fault,
    *,
    after_turns: int,
) -> float:
    """Replay ``sessions``, striking ``engine_id`` with ``fault`` once ``after_turns`` turns
    have finished and it holds requests, and check the outcome; when the fault was."""
    fault_at_s: list[float] = []
    before = target.metric("dualpath_scheduler_replaced_requests_total")

    def strike(done: list[TurnRecord], has_ended: threading.Event) -> bool:
        if not strike_while_holding(
            target.url,
            engine_id,
            fault,
            is_ready=lambda _: len(done) >= after_turns,
            should_stop=has_ended.is_set,
        ):
            return False
        fault_at_s.append(time.monotonic())
        return True

    def check(records: dict[tuple[int, int], TurnRecord]) -> None:
        errors = [r.error for r in records.values() if r.error is not None]
        assert errors == [], errors[:3]  # no client-visible error
        assert records.keys() == reference.keys()  # no request lost
        differ = [k for k, r in records.items() if r.output_digest != reference[k].output_digest]
        assert differ == [], (
            f"{len(differ)} turns' tokens differ from the undisturbed run: {differ}"
        )

    replay_until_struck(target, sessions, strike, check)
    # /metrics shows the scheduler's snapshot, republished every 0.1 s: the last requests placed
    # again can have finished (and the replay ended) before one taken after them is published.
    snapshot_after_now(target.url)
    replaced = target.metric("dualpath_scheduler_replaced_requests_total") - before
    delay_s = target.metric("dualpath_scheduler_replacement_first_token_max_seconds")
    print(
        f"\nengine {engine_id}'s fault: {replaced:.0f} requests placed again, the longest "
        f"from a fault to a re-placed request's next token {delay_s:.3f} s; the run ended "
        f"{time.monotonic() - fault_at_s[0]:.1f} s after the fault"
    )
    assert replaced >= 1, "the fault hit no request (strike_while_holding should make sure)"
    return fault_at_s[0]


def deaths_of(target: Target, engine_id: int) -> int:
    return target.health()["engine_deaths"].get(str(engine_id), 0)


def wait_until_back(target: Target, engine_id: int, since_s: float, deaths_before: int) -> None:
    """Until /health has counted the engine's death and shows every engine live again (one
    restarted quickly joins again before its silence is noticed: it is never listed dead)."""
    while True:
        body = target.health()
        has_died = body["engine_deaths"].get(str(engine_id), 0) > deaths_before
        if has_died and body["num_live_engines"] == target.num_engines:
            break
        assert time.monotonic() - since_s < BACK_TIMEOUT_S, body
        time.sleep(0.02)
    print(f"engine {engine_id} back in /health {time.monotonic() - since_s:.1f} s after the fault")
    assert body["dead_engines"] == {}


def terminate_in_a_loss(
    target: Target, sessions, engine_id: int, pid_of: Callable[[], int], terminate
) -> None:
    """Replay ``sessions``; once FAIL_DECODE_AFTER_TURNS turns have finished, SIGKILL engine
    ``engine_id`` while it holds requests, and call ``terminate`` as soon as /health counts
    its death (its requests are being placed again, so the run cannot have ended). Turns that
    fail from then on are not checked."""
    deaths = deaths_of(target, engine_id)

    def strike(done: list[TurnRecord], has_ended: threading.Event) -> bool:
        if not strike_while_holding(
            target.url,
            engine_id,
            Kill(pid_of),
            is_ready=lambda _: len(done) >= FAIL_DECODE_AFTER_TURNS,
            should_stop=has_ended.is_set,
        ):
            return False
        deadline_s = time.monotonic() + EXIT_TIMEOUT_S
        while deaths_of(target, engine_id) == deaths:
            assert time.monotonic() < deadline_s, f"engine {engine_id}'s death never counted"
            time.sleep(0.02)
        terminate()
        return True

    replay_until_struck(target, sessions, strike)


def processes_of(home: Path) -> list[int]:
    """Running processes started with DUALPATH_HOME=``home`` (a server and its engines)."""
    wanted = f"DUALPATH_HOME={home}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if wanted in environ and is_running(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def wait_until_none_left(home: Path, timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while left := processes_of(home):
        assert time.monotonic() < deadline_s, f"processes left behind: {left}"
        time.sleep(0.05)


def no_half_written_blocks(store_dir: Path) -> None:
    """A block is written to a temporary file and renamed into place: none may be left."""
    assert store_dir.is_dir()
    temporary = [p for p in store_dir.rglob(".*") if is_temp_name(p.name)]
    assert temporary == [], f"store writes left half-done: {temporary[:3]}"


@pytest.mark.timeout(900)  # a hang guard: five replays of 96 turns, three faults, two servers
def test_conversations_survive_engine_kills_unchanged(tiny_model_dir: Path, tmp_path: Path) -> None:
    sessions = conversations(tiny_model_dir)
    assert len(sessions) == NUM_CONVERSATIONS
    with start_server(tiny_model_dir, tmp_path, "--nodes", "2P2D") as server:
        target = Target(server.url, MODEL, API_KEY, lambda: server.health().json(),
                        lambda name: metric_of(server.url, name), 4)  # fmt: skip
        reference = undisturbed(target, sessions)
        for engine_id, after_turns in ((2, FAIL_DECODE_AFTER_TURNS), (0, 0)):  # DE, PE
            kill = Kill(lambda engine_id=engine_id: engine_pids(server)[engine_id])
            deaths = deaths_of(target, engine_id)
            fault_s = replay_through_fault(
                target, sessions, reference, engine_id, kill, after_turns=after_turns
            )
            wait_until_back(target, engine_id, fault_s, deaths)  # restarted under its id
            assert target.health()["engine_restarts"][str(engine_id)] == 1

        # SIGTERM in the middle of a decode engine's loss.
        terminate_in_a_loss(
            target,
            sessions,
            3,
            lambda: engine_pids(server)[3],
            terminate=server.process.terminate,
        )
        assert server.process.wait(EXIT_TIMEOUT_S) == 0
        wait_until_none_left(tmp_path / "home", EXIT_TIMEOUT_S)
    no_half_written_blocks(tmp_path / "kv")
    # A new server on the same store: what was written reads back as the same tokens.
    again_root = tmp_path / "again"
    again_root.mkdir()
    with start_server(
        tiny_model_dir, again_root, "--nodes", "2P2D", "--kv-store", str(tmp_path / "kv")
    ) as again:
        target = Target(again.url, MODEL, API_KEY, lambda: again.health().json(),
                        lambda name: metric_of(again.url, name), 4)  # fmt: skip
        same_tokens_from_the_store(target, sessions, reference)


def metric_of(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def same_tokens_from_the_store(target: Target, sessions, reference) -> None:
    records = replay(target, sessions)
    assert all(r.error is None for r in records.values())
    assert {k: r.output_digest for k, r in records.items()} == {
        k: r.output_digest for k, r in reference.items()
    }
    assert sum(r.num_cached_tokens for r in records.values()) > 0, "nothing read from the store"
    assert target.metric("dualpath_store_corrupt_blocks_total") == 0


@pytest.mark.timeout(1200)  # a hang guard: six replays of 96 turns, four faults, two clusters
def test_conversations_survive_host_cuts_and_kills_on_the_multi_host_cluster(
    test_hosts, gluster_volume, tiny_model_dir: Path, tmp_path: Path
) -> None:
    sessions = conversations(tiny_model_dir)
    namespace = f"conversations-{tmp_path.name}"

    def store_dir_of(host):
        return gluster_volume.mount_point(host) / namespace

    with MultiHostCluster(
        test_hosts.hosts,
        model_dir=tiny_model_dir,
        log_dir=tmp_path,
        store_dir_of=store_dir_of,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        nodes="2P2D",
        restart_engines=True,
    ) as cluster:
        target = Target(cluster.url, "tiny", None, cluster.health, cluster.metric, 4)
        reference = undisturbed(target, sessions)
        # A decode host cut off: its engine loses the scheduler, exits, and its
        # `dualpath engine` starts it again until it rejoins, once the link is back.
        host = next(s.host for s in cluster.engines if s.engine_id == 3)
        deaths = deaths_of(target, 3)
        try:
            fault_s = replay_through_fault(
                target,
                sessions,
                reference,
                3,
                Cut(test_hosts, host),
                after_turns=FAIL_DECODE_AFTER_TURNS,
            )
        finally:
            test_hosts.set_link_up(host, True)
        wait_until_back(target, 3, fault_s, deaths)
        # A prefill engine, then a decode engine, SIGKILLed: started again on their hosts.
        for engine_id, after_turns in ((1, 0), (2, FAIL_DECODE_AFTER_TURNS)):
            kill = Kill(lambda engine_id=engine_id: cluster.engine_pid(engine_id))
            deaths = deaths_of(target, engine_id)
            fault_s = replay_through_fault(
                target, sessions, reference, engine_id, kill, after_turns=after_turns
            )
            wait_until_back(target, engine_id, fault_s, deaths)

        # SIGTERM to the server in the middle of a decode engine's loss. The live engines
        # are told to stop and exit 0; the killed one's restart, unless it rejoined before
        # the server left (and was told to stop too), finds no scheduler and goes on trying
        # (it waits for its scheduler, as a host's engine should) until SIGTERM.
        supervisors = cluster.engine_id_to_process
        terminate_in_a_loss(
            target,
            sessions,
            3,
            lambda: cluster.engine_pid(3),
            terminate=cluster.server.terminate,
        )
        assert cluster.server.wait(EXIT_TIMEOUT_S) == 0
        for engine_id in (0, 1, 2):
            assert supervisors[engine_id].wait(EXIT_TIMEOUT_S) == 0, f"engine {engine_id}"
        supervisors[3].terminate()  # nothing when it has exited already
        assert supervisors[3].wait(EXIT_TIMEOUT_S) == 0
        wait_until_none_left(tmp_path / "home", EXIT_TIMEOUT_S)
    no_half_written_blocks(store_dir_of(test_hosts.hosts[0]))
    again = MultiHostCluster(
        test_hosts.hosts,
        model_dir=tiny_model_dir,
        log_dir=tmp_path / "again",
        store_dir_of=store_dir_of,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        nodes="2P2D",
    )
    with again:
        target = Target(again.url, "tiny", None, again.health, again.metric, 4)
        same_tokens_from_the_store(target, sessions, reference)
