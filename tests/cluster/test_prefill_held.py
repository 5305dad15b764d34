"""The scheduler tells both engines of a placement, in the one Assignment they share, whether
the DE's reads wait for the PE's ``PrefillHeld``: only where the PE said in its EngineInfo that
it reports what its engine holds, and the DE has hit blocks of its side to read."""

from __future__ import annotations

import pytest

from dualpath.protocol import Assignment
from tests.cluster.scripted import one_request_on_1p1d

PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4


def _assignment(*, reports: bool, num_hit_blocks: int) -> Assignment:
    """The Assignment of one request placed on a 1P1D cluster whose DE reads every hit."""
    pe_info = {"reports_prefill_held": reports}
    placed = one_request_on_1p1d(PROMPT, num_hit_blocks, read_path="de", pe_info=pe_info)
    with placed as (_, pe, de):
        (pe_view,) = pe.receive(Assignment)
        (de_view,) = de.receive(Assignment)
    assert pe_view == de_view  # both decide from the same bytes
    assert pe_view.num_decode_side_blocks == num_hit_blocks
    return pe_view


@pytest.mark.parametrize("reports", [True, False])
def test_the_de_waits_only_for_a_pe_that_reports(reports: bool) -> None:
    assert _assignment(reports=reports, num_hit_blocks=2).is_prefill_held_sent is reports


def test_nothing_is_awaited_without_de_side_hits() -> None:
    assert not _assignment(reports=True, num_hit_blocks=0).is_prefill_held_sent
