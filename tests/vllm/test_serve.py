"""`dualpath serve --engine vllm` on the embedded checkpoint, three servers in turn, each test
class one server (started once for the class; its tests run in order, on what the earlier ones
left in the server and its store):

- ``TestFirstServer`` (1P2D, ``--read-path pe``, a new store, ``--vllm-prefill-batching
  quota``): token-id prompts of 300-4,000 tokens give plain vLLM's greedy tokens (its own
  `LLM`, no connector) cold and warm; a chat's turn 2 finds turn 1 in the store; 8
  conversations of 3 turns (``Conversations``) read on the PE side; 6 prompts sent at once,
  each its own quota batch, give plain vLLM's tokens; a new 4,000-token prompt prefilled while
  two busy processes load both cores declares no engine dead and gives plain vLLM's tokens; a
  decode engine SIGKILLed while 8 streams decode: every stream goes on elsewhere with plain
  vLLM's tokens, and the engine is started again and rejoins.
- ``TestRestartedServer`` (1P2D, ``--read-path de``, the first server's store): its new engines
  hold nothing, so every hit of the same prompts is read from the store, once, with the same
  tokens; the same conversations with every hit read on the DE side (pulled layer by layer by
  the PE's connector); then a decode engine is killed while 8 streams decode whose prompts the
  first server stored, so the killed engine holds hit KV that the PE pulls from it for requests
  still waiting for their prefill.
- ``TestSplitServer`` (1P2D, ``split``, a new store): the same conversations, read by both
  sides.

Every read path gives the conversations the same tokens, and plain vLLM's; on every path the
two sides' reads plus the hit KV the PE's vLLM still held (not read again) are exactly the
cached tokens' KV. Every server runs at serve's default heartbeat timeout (10 s): an engine in
one long step is kept alive by its heartbeat thread. A first difference from plain vLLM is accepted only where its top two tokens
were within 1e-3 in logprob (vLLM need not be bit-exact between a cached and an uncached
prefill), and counted. Fault strikes wait until the engine is seen holding requests
(``tests/faults/strike.py``: sure to hit one, on any machine); every wait is a hang guard.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.faults.strike import (
    Kill,
    Samples,
    engine_sample,
    snapshot_after_now,
    strike_while_holding,
)
from tests.server.serving import MODEL, Server, auth, engine_pids, metric_values, start_server
from tests.vllm.reference import PlainVllm, near_ties

pytestmark = pytest.mark.vllm

CONTEXT = 4160  # 4,000-token prompts + output, in whole 64-token blocks
BLOCK = 64
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32: layers x K,V x heads x dims
HANG_GUARD_S = 600
DEATHS_SERIES = "dualpath_engine_deaths_total"
READ_SERIES = "dualpath_read_path_bytes_total"
HELD_SERIES = "dualpath_engine_cached_bytes_total"

# A short prompt, one of a few blocks, one over vLLM's 2,048-token prefill chunk, the longest.
PROMPT_LENGTHS = (300, 1200, 2400, 4000)
MAX_TOKENS = 8

NUM_SESSIONS, NUM_TURNS = 8, 3

QUOTA_PROMPT_LENGTHS = (300, 450, 600, 750, 900, 1050)

NUM_STREAMS = 8
STREAM_TOKENS = 96  # long enough that the lost engine's streams have tokens left to go on
VICTIM_ID = 2  # 1P2D: engine 0 is the PE, 1 and 2 the DEs


def _serve(
    model_dir: Path, root: Path, nodes: str, read_path: str, *extra_args: str
) -> Iterator[Server]:
    args = ("--engine", "vllm", "--nodes", nodes, "--read-path", read_path)
    # serve's advice where engines share cores: the PE's prefill on both (these tests send one
    # request at a time, a PE of one thread left a core idle), each DE on one.
    args += ("--threads", "2", "--decode-threads", "1")
    args += ("--max-model-len", str(CONTEXT), *extra_args)  # a later flag wins
    with start_server(model_dir, root, *args) as server:
        yield server


@pytest.fixture(scope="module")
def first_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first server's store and logs; the restarted server's too."""
    return tmp_path_factory.mktemp("first")


# --- replays and what /metrics says of them --------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(100, 40_000, n).tolist() for n in PROMPT_LENGTHS]


def _full_blocks_bytes(lengths: tuple[int, ...]) -> int:
    """The KV of every whole block of each prompt but its last token's: what a warm request
    finds cached."""
    return sum((n - 1) // BLOCK * BLOCK for n in lengths) * KV_BYTES_PER_TOKEN


@pytest.fixture(scope="module")
def references(plain_vllm: PlainVllm) -> list[dict]:
    return plain_vllm.generate([(prompt, MAX_TOKENS) for prompt in _prompts()])


def _replay(server: Server, references: list[dict], label: str, *, is_warm: bool) -> int:
    """Near ties met; every prompt's tokens checked against plain vLLM's, and its cached
    tokens: all its full blocks when warm (from the store, or vLLM's own prefix cache)."""
    client = server.client.with_options(timeout=HANG_GUARD_S)
    num_ties = 0
    for prompt, reference in zip(_prompts(), references, strict=True):
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        num_ties += near_ties(reference, out.choices[0].token_ids, f"{label} {len(prompt)}")
        cached = out.usage.prompt_tokens_details.cached_tokens
        assert cached == ((len(prompt) - 1) // BLOCK * BLOCK if is_warm else 0), (
            label,
            len(prompt),
        )
    return num_ties


def _hit_bytes(server: Server) -> dict[str, float]:
    """Hit KV so far, read per side (``prefill``, ``decode``) and held by the PE's vLLM
    (``engine``: not read again)."""
    hits = {"prefill": 0.0, "decode": 0.0, "engine": 0.0}
    for (name, labels), value in metric_values(server).items():
        if name == READ_SERIES:
            hits[dict(labels)["side"]] += value
        elif name == HELD_SERIES:
            hits["engine"] += value
    return hits


def _settled_hit_bytes(server: Server, total_bytes: float) -> dict[str, float]:
    """``_hit_bytes`` once the engines' periodic reports add up to ``total_bytes`` (60 s at
    most: then as they are, for the caller's assertion to show)."""
    deadline = time.monotonic() + 60
    while True:
        hits = _hit_bytes(server)
        if sum(hits.values()) == total_bytes or time.monotonic() > deadline:
            return hits
        time.sleep(0.5)


class Conversations:
    """8 conversations of 3 turns (token ids, greedy), one request at a time; each turn's
    prompt is the last one, its answer and new user tokens. A run records, per read path, the
    prompts, the tokens and the hit KV per side; the last class compares them."""

    def __init__(self) -> None:
        self.prompts: dict[str, dict] = {}
        self.tokens: dict[str, dict] = {}
        self.hits: dict[str, dict[str, float]] = {}

    @staticmethod
    def _openings() -> list[list[int]]:
        rng = np.random.default_rng(1)
        return [rng.integers(100, 40_000, 200 + 90 * s).tolist() for s in range(NUM_SESSIONS)]

    @staticmethod
    def _new_user_tokens(session: int, turn: int) -> list[int]:
        return np.random.default_rng(100 * session + turn).integers(100, 40_000, 70).tolist()

    def run(self, server: Server, read_path: str) -> None:
        """Every turn on ``server`` (its earlier hits settled); its hit KV must be exactly the
        cached tokens' KV."""
        before = _hit_bytes(server)
        client = server.client.with_options(timeout=HANG_GUARD_S)
        prompts, tokens, num_cached = {}, {}, 0
        contexts = self._openings()
        for turn in range(NUM_TURNS):
            for session in range(NUM_SESSIONS):
                prompt = contexts[session]
                out = client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )  # fmt: skip
                answer = list(out.choices[0].token_ids)
                prompts[session, turn], tokens[session, turn] = prompt, answer
                num_cached += out.usage.prompt_tokens_details.cached_tokens
                contexts[session] = prompt + answer + self._new_user_tokens(session, turn)
        assert num_cached > 0, read_path
        expected_bytes = num_cached * KV_BYTES_PER_TOKEN
        after = _settled_hit_bytes(server, sum(before.values()) + expected_bytes)
        hits = {side: after[side] - before[side] for side in after}
        assert sum(hits.values()) == expected_bytes, (read_path, hits)
        self.prompts[read_path], self.tokens[read_path] = prompts, tokens
        self.hits[read_path] = hits

    def near_ties_from(self, plain_vllm: PlainVllm, read_path: str) -> int:
        """Every turn of ``read_path``'s run checked against plain vLLM's tokens for its
        prompt: the near ties met."""
        prompts, tokens = self.prompts[read_path], self.tokens[read_path]
        keys = sorted(prompts)
        references = plain_vllm.generate([(prompts[key], MAX_TOKENS) for key in keys])
        return sum(
            near_ties(reference, tokens[key], f"session {key[0]} turn {key[1]}")
            for key, reference in zip(keys, references, strict=True)
        )


@pytest.fixture(scope="module")
def conversations() -> Conversations:
    return Conversations()


# --- a decode engine killed under load -------------------------------------------------------


def _stream_prompts() -> list[list[int]]:
    return [[(seed * 7919 + i * 104729) % 30_000 + 100 for i in range(300 + 40 * seed)]
            for seed in range(NUM_STREAMS)]  # fmt: skip


@pytest.fixture(scope="module")
def stream_references(plain_vllm: PlainVllm) -> list[dict]:
    return plain_vllm.generate([(prompt, STREAM_TOKENS) for prompt in _stream_prompts()])


def _stream(server: Server, prompt: list[int]) -> dict:
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": STREAM_TOKENS, "ignore_eos": True,
        "temperature": 0, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    result: dict = {"token_ids": [], "error": None}
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=auth(), timeout=HANG_GUARD_S) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result["error"] = event["error"]["message"]
            else:
                result["token_ids"] += event["choices"][0]["token_ids"]
    return result


def _decode_read_bytes(samples: Samples) -> float:
    return samples.get((READ_SERIES, (("side", "decode"),)), 0.0)


def _kill_a_decode_engine_under_load(
    server: Server, references: list[dict], read_path: str
) -> None:
    """8 streams; engine VICTIM_ID SIGKILLed once it decodes (and, on ``de``, has read hit KV
    on the DE side) and holds some: every stream ends with plain vLLM's tokens, no client sees
    an error, at least one is placed again, and the engine comes back under its id."""
    pid_before = engine_pids(server)[VICTIM_ID]
    samples = metric_values(server)
    busy_before = engine_sample(samples, "dualpath_engine_busy_seconds_total", VICTIM_ID)
    decode_before = _decode_read_bytes(samples)
    replaced_before = samples.get(("dualpath_scheduler_replaced_requests_total", ()), 0.0)

    def is_decoding(samples: Samples) -> bool:  # its requests have tokens to go on from
        if read_path == "de" and _decode_read_bytes(samples) == decode_before:
            return False  # and it has read these streams' hit KV on the DE side
        busy_s = engine_sample(samples, "dualpath_engine_busy_seconds_total", VICTIM_ID)
        return busy_s > busy_before

    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(_stream, server, prompt) for prompt in _stream_prompts()]
        struck = strike_while_holding(
            server.url,
            VICTIM_ID,
            Kill(lambda: engine_pids(server)[VICTIM_ID]),
            is_ready=is_decoding,
            should_stop=lambda: all(f.done() for f in futures),
        )
        assert struck, f"every stream ended before engine {VICTIM_ID} held one"
        killed_s = time.monotonic()
        streams = [f.result() for f in futures]
    print(f"\nvLLM DE killed: the streams ended {time.monotonic() - killed_s:.1f} s after")
    assert [(s["status"], s["error"]) for s in streams] == [(200, None)] * NUM_STREAMS
    num_ties = sum(
        near_ties(reference, stream["token_ids"], f"stream {i}")
        for i, (stream, reference) in enumerate(zip(streams, references, strict=True))
    )
    snapshot_after_now(server.url)  # one that counts the last streams placed again
    samples = metric_values(server)
    replaced = samples[("dualpath_scheduler_replaced_requests_total", ())] - replaced_before
    assert replaced >= 1, "the kill hit no stream"
    if read_path == "de":  # every hit was read on the DE side
        assert _decode_read_bytes(samples) > decode_before
        assert samples.get((READ_SERIES, (("side", "prefill"),)), 0.0) == 0
    print(f"{replaced:.0f} stream(s) placed again; {num_ties} near-tie difference(s)")
    # Started again under the same id, it rejoins: /health counts 3 live engines.
    deadline_s = time.monotonic() + HANG_GUARD_S
    while (
        server.health().json()["num_live_engines"] != 3
        or engine_pids(server).get(VICTIM_ID) == pid_before
    ):
        assert time.monotonic() < deadline_s, server.health().text
        time.sleep(0.5)
    out = server.client.with_options(timeout=HANG_GUARD_S).completions.create(
        model=MODEL, prompt=_stream_prompts()[0], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    first = {key: value[:4] for key, value in references[0].items()}
    near_ties(first, out.choices[0].token_ids, "after the restart")


# --- the servers -----------------------------------------------------------------------------


class TestFirstServer:
    """With ``--vllm-prefill-batching quota``: the PE hands vLLM one batch at a time from the
    compute-quota batcher (its predictor profiled on vLLM at start, on contexts up to 2,048),
    here with a quota so small that every batch holds one request."""

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, smollm2_model_dir: Path, first_root: Path) -> Iterator[Server]:
        quota = ("--vllm-prefill-batching", "quota", "--attention-quota-s", "0.00001")
        yield from _serve(smollm2_model_dir, first_root, "1P2D", "pe", *quota)

    def test_tokens_are_plain_vllms_cold_and_warm(
        self, server: Server, references: list[dict]
    ) -> None:
        num_ties = _replay(server, references, "cold", is_warm=False)
        assert sum(_hit_bytes(server).values()) == 0
        num_ties += _replay(server, references, "warm", is_warm=True)
        # The PE's vLLM still holds most prompts: those blocks are not read from the store.
        read_bytes = _settled_hit_bytes(server, _full_blocks_bytes(PROMPT_LENGTHS))
        assert read_bytes["prefill"] + read_bytes["decode"] < _full_blocks_bytes(PROMPT_LENGTHS)
        print(f"{num_ties} near-tie difference(s) in {2 * len(PROMPT_LENGTHS)} prompts")

    def test_turn_two_of_a_chat_finds_turn_one_in_the_store(self, server: Server) -> None:
        readme = (Path(__file__).parents[2] / "README.md").read_text()[:4000]
        messages = [{"role": "user", "content": f"{readme}\n\nIn one sentence, what is this?"}]
        client = server.client.with_options(timeout=HANG_GUARD_S)
        first = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=48
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And what does `make test` do?"},
        ]
        second = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=8
        )
        turn_one = first.usage.prompt_tokens + first.usage.completion_tokens
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens > 1000 and cached >= 0.9 * turn_one, (cached, turn_one)
        # Under a cache salt, turn 2 finds none of it (neither in the store nor in the PE's
        # vLLM prefix cache, which holds it unsalted), then all of its own first try.
        salted = [
            client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=8,
                extra_body={"cache_salt": "tenant-b"},
            )
            for _ in range(2)
        ]  # fmt: skip
        whole = (second.usage.prompt_tokens - 1) // BLOCK * BLOCK
        assert [out.usage.prompt_tokens_details.cached_tokens for out in salted] == [0, whole]

    def test_the_agents_apis_give_the_chat_answer(self, server: Server) -> None:
        """/v1/messages and /v1/responses on vLLM engines: the chat route's tokens."""
        question = [{"role": "user", "content": "What is the capital of France?"}]
        client = server.client.with_options(timeout=HANG_GUARD_S)
        chat = client.chat.completions.create(
            model=MODEL, messages=question, temperature=0, max_tokens=12
        )
        response = client.responses.create(
            model=MODEL, input=question, temperature=0, max_output_tokens=12
        )
        messages = server.http.post(
            "/v1/messages",
            json={"model": MODEL, "messages": question, "temperature": 0, "max_tokens": 12},
            timeout=HANG_GUARD_S,
        )
        assert messages.status_code == 200, messages.text
        text = chat.choices[0].message.content
        assert response.output_text == text == messages.json()["content"][0]["text"]
        assert response.usage.input_tokens == chat.usage.prompt_tokens

    def test_conversations_read_on_the_prefill_side(
        self, server: Server, conversations: Conversations
    ) -> None:
        conversations.run(server, "pe")
        assert conversations.hits["pe"]["decode"] == 0, conversations.hits["pe"]

    def test_quota_batches_of_prompts_sent_at_once_give_plain_vllms_tokens(
        self, server: Server, plain_vllm: PlainVllm
    ) -> None:
        """6 prompts sent at once queue in the batcher, one batch each."""
        rng = np.random.default_rng(7)
        prompts = [rng.integers(100, 40_000, n).tolist() for n in QUOTA_PROMPT_LENGTHS]
        references = plain_vllm.generate([(p, MAX_TOKENS) for p in prompts])
        client = server.client.with_options(timeout=HANG_GUARD_S)

        def complete(prompt: list[int]) -> list[int]:
            out = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            return list(out.choices[0].token_ids)

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(complete, prompts))
        for prompt, tokens, reference in zip(prompts, outputs, references, strict=True):
            near_ties(reference, tokens, f"prompt of {len(prompt)}")

    def test_a_long_prefill_beside_a_busy_neighbour_declares_no_engine_dead(
        self, server: Server, plain_vllm: PlainVllm
    ) -> None:
        """Two processes spin on both cores while the PE's vLLM prefills a new 4,000-token
        prompt: its one step may outlast the 10 s heartbeat timeout (11.1 s beside one 2-core
        job declared the PE dead before engines had a heartbeat thread); it is busy, not
        dead."""
        prompt = np.random.default_rng(4000).integers(100, 40_000, 4000).tolist()
        (reference,) = plain_vllm.generate([(prompt, MAX_TOKENS)])  # before the load
        deaths_before = _engine_deaths(server)
        busy_steps_s = _BusyWatch(server)
        spin = [sys.executable, "-c", "while True: pass"]
        neighbours = [subprocess.Popen(spin) for _ in range(2)]
        try:
            start_s = time.monotonic()
            out = server.client.with_options(timeout=HANG_GUARD_S).completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            elapsed_s = time.monotonic() - start_s
        finally:
            for neighbour in neighbours:
                neighbour.kill()
                neighbour.wait()
            busy_steps_s.stop()
        print(
            f"4,000-token prompt beside a busy neighbour: {elapsed_s:.1f} s; longest step "
            f"reported busy: {max(busy_steps_s.steps_s, default=0.0):.1f} s"
        )
        assert out.usage.prompt_tokens_details.cached_tokens == 0  # a whole prefill
        near_ties(reference, out.choices[0].token_ids, "beside a busy neighbour")
        assert server.health().json()["engine_deaths"] == {}
        assert _engine_deaths(server) == deaths_before

    def test_a_killed_decode_engines_streams_go_on_and_it_comes_back(
        self, server: Server, stream_references: list[dict]
    ) -> None:
        _kill_a_decode_engine_under_load(server, stream_references, "pe")


def _engine_deaths(server: Server) -> dict[tuple, float]:
    return {k: v for k, v in metric_values(server).items() if k[0] == DEATHS_SERIES}


class _BusyWatch:
    """The busy engines' step times /health shows, read every half second until ``stop``."""

    def __init__(self, server: Server) -> None:
        self.steps_s: list[float] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(server,))
        self._thread.start()

    def _watch(self, server: Server) -> None:
        while not self._stopping.wait(0.5):
            with contextlib.suppress(httpx.HTTPError):  # (a slow answer: the next one)
                self.steps_s += server.health().json().get("busy_engines", {}).values()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


class TestRestartedServer:
    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, smollm2_model_dir: Path, first_root: Path) -> Iterator[Server]:
        assert (first_root / "kv").is_dir(), "TestFirstServer fills the store this one reads"
        yield from _serve(smollm2_model_dir, first_root, "1P2D", "de")

    def test_every_hit_is_read_from_the_store_once_with_the_same_tokens(
        self, server: Server, references: list[dict]
    ) -> None:
        num_ties = _replay(server, references, "restarted", is_warm=True)
        # New engines hold nothing: every hit block is read from the store, once, on the DE
        # side.
        cached_bytes = _full_blocks_bytes(PROMPT_LENGTHS)
        hits = _settled_hit_bytes(server, cached_bytes)
        assert hits == {"prefill": 0, "decode": cached_bytes, "engine": 0}, hits
        print(f"{num_ties} near-tie difference(s) in {len(PROMPT_LENGTHS)} prompts")

    def test_conversations_read_on_the_decode_side(
        self, server: Server, conversations: Conversations
    ) -> None:
        conversations.run(server, "de")
        hits = conversations.hits["de"]
        assert hits["decode"] > 0 and hits["prefill"] == 0, hits

    def test_a_killed_decode_engines_streams_go_on_and_it_comes_back(
        self, server: Server, stream_references: list[dict]
    ) -> None:
        _kill_a_decode_engine_under_load(server, stream_references, "de")


class TestSplitServer:
    @pytest.fixture(scope="class")
    @classmethod
    def server(
        cls, smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Server]:
        yield from _serve(smollm2_model_dir, tmp_path_factory.mktemp("split"), "1P2D", "split")

    def test_conversations_read_on_both_sides(
        self, server: Server, conversations: Conversations
    ) -> None:
        conversations.run(server, "split")
        # (The PE side's share of a split is mostly in the PE's vLLM already: later turns of
        # a session find their earlier prompts there. A load of both PE-read and DE-read
        # blocks is tests/vllm/test_connector.py's.)
        assert conversations.hits["split"]["decode"] > 0, conversations.hits["split"]


def test_every_read_path_gives_the_conversations_plain_vllms_tokens(
    conversations: Conversations, plain_vllm: PlainVllm
) -> None:
    assert set(conversations.tokens) == {"pe", "de", "split"}, "the servers above replay them"
    print({path: {side: int(b) for side, b in h.items()} for path, h in conversations.hits.items()})
    assert conversations.tokens["de"] == conversations.tokens["pe"]
    assert conversations.tokens["split"] == conversations.tokens["pe"]
    num_ties = conversations.near_ties_from(plain_vllm, "pe")
    print(
        f"{num_ties} near-tie difference(s) from plain vLLM in {len(conversations.tokens['pe'])} turns"
    )
