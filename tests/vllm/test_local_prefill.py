"""`dualpath serve --engine vllm --local-prefill-tokens 150` (conditional disaggregation), 1P1D
on a new store, each engine's vLLM holding 67 blocks of 64 tokens: test_serve's 8 conversations
of 3 turns, one request at a time. A first turn (200-830 tokens, none cached) goes through the
PE; a later one misses at most 78 new tokens and a partial block (at most 141), so it goes to
its DE alone, which reads the hit blocks its vLLM no longer holds (the 8 sessions' first turns
take 82 blocks, so the least recently used are gone), prefills the rest and decodes on. Every
turn's tokens are plain vLLM's (near ties), the hit KV read plus held is exactly the cached
tokens' KV, and /metrics counts the local prefills."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.serving import Server, metric_values
from tests.vllm.reference import PlainVllm
from tests.vllm.test_serve import NUM_SESSIONS, NUM_TURNS, Conversations, _serve

pytestmark = pytest.mark.vllm

LOCAL_PREFILL_TOKENS = 150
LOCAL_SERIES = "dualpath_scheduler_local_prefills_total"


@pytest.fixture(scope="module")
def server(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("local")
    local = ("--local-prefill-tokens", str(LOCAL_PREFILL_TOKENS), "--kv-cache-gb", "0.2")
    yield from _serve(smollm2_model_dir, root, "1P1D", "dual", *local)


def test_short_appends_prefilled_on_the_decode_engine_give_plain_vllms_tokens(
    server: Server, plain_vllm: PlainVllm
) -> None:
    conversations = Conversations()
    conversations.run(server, "local")  # the hit KV read and held checked there
    num_local = metric_values(server)[(LOCAL_SERIES, ())]
    # The later turns' hits wait for the blocks their earlier turn's DE is still writing
    # (--persist-wait-s): each misses what the bound above says, whatever the timing.
    assert num_local == NUM_SESSIONS * (NUM_TURNS - 1), num_local
    hits = conversations.hits["local"]
    assert hits["decode"] > 0 and hits["prefill"] == 0, hits  # the DE read what vLLM lost
    num_ties = conversations.near_ties_from(plain_vllm, "local")
    print(
        f"{hits}; {num_ties} near-tie difference(s) from plain vLLM in {NUM_SESSIONS * NUM_TURNS} turns"
    )
