"""Conditional disaggregation (``ClusterConfig.local_prefill_tokens``): a request the store
misses by at most that many tokens goes to its DE alone, every hit block on the DE side, where
the DE said in its EngineInfo that it prefills (``prefills_locally``); any other goes to both
engines as before. The DE's own PrefillDone streams the first token and is not relayed back to
it."""

from __future__ import annotations

import pytest

from dualpath.protocol import Assignment, PrefillDone
from tests.cluster.scripted import one_request_on_1p1d, settle

PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4, the store holding the first 2
NUM_HIT_BLOCKS = 2
NUM_MISSED = len(PROMPT) - 4 * NUM_HIT_BLOCKS  # 5


def _place(local_prefill_tokens: int, *, de_prefills: bool) -> tuple[list, list, list]:
    """One request on a 1P1D cluster, then, if its DE got it alone, the DE's PrefillDone: what
    the PE and the DE received (Assignments, then PrefillDones), and the tokens streamed."""
    with one_request_on_1p1d(
        PROMPT,
        NUM_HIT_BLOCKS,
        read_path="pe",
        de_info={"prefills_locally": de_prefills},
        local_prefill_tokens=local_prefill_tokens,
    ) as (coordinator, pe, de):
        received = [pe.receive(Assignment), de.receive(Assignment)]
        if received[1] and received[1][0].is_local_prefill:
            de.client.send(PrefillDone(received[1][0].request_id, 42, None, 8))
            settle(coordinator, [pe, de])
        received[0] += pe.receive(PrefillDone)
        received[1] += de.receive(PrefillDone)
        tokens = [event.token_ids for event in coordinator.drain_events() if event.token_ids]
    return received[0], received[1], tokens


@pytest.mark.parametrize("local_prefill_tokens", [NUM_MISSED, 100])
def test_a_short_append_goes_to_its_de_alone(local_prefill_tokens: int) -> None:
    to_pe, to_de, tokens = _place(local_prefill_tokens, de_prefills=True)
    assert to_pe == []
    (assignment,) = to_de  # and no PrefillDone relayed back to it
    assert assignment.is_local_prefill and assignment.prefill_engine_id == 1
    assert (assignment.num_prefill_side_blocks, assignment.num_decode_side_blocks) == (0, 2)
    assert not assignment.is_prefill_held_sent
    assert tokens == [(42,)]


@pytest.mark.parametrize(
    ("local_prefill_tokens", "de_prefills"),
    [(NUM_MISSED - 1, True), (0, True), (100, False)],
)
def test_a_longer_one_or_a_de_that_cannot_goes_through_the_pe(
    local_prefill_tokens: int, de_prefills: bool
) -> None:
    to_pe, to_de, _ = _place(local_prefill_tokens, de_prefills=de_prefills)
    assert len(to_pe) == len(to_de) == 1 and to_pe == to_de
    (assignment,) = to_pe
    assert not assignment.is_local_prefill
    assert (assignment.prefill_engine_id, assignment.decode_engine_id) == (0, 1)
    assert assignment.num_prefill_side_blocks == NUM_HIT_BLOCKS  # read_path "pe"
