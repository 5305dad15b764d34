"""Assertions shared by the engine tests."""

from __future__ import annotations

from collections.abc import Sequence

# Below this top-2 logit margin, a divergence is attributed to float rounding, not a bug.
MARGIN_TOLERANCE = 1e-4


def assert_same_tokens(reference, other, *, label: str = "") -> None:
    """Token ids must match; where they diverge, the reference's top-2 margin at the first
    divergence must be below MARGIN_TOLERANCE (both outputs need ``logprobs >= 2``)."""
    ref_ids: Sequence[int] = reference.token_ids
    ids: Sequence[int] = other.token_ids
    if list(ref_ids) == list(ids):
        return
    index = next(
        (i for i, (a, b) in enumerate(zip(ref_ids, ids, strict=False)) if a != b),
        min(len(ref_ids), len(ids)),
    )
    margin = None
    if reference.logprobs is not None and index < len(reference.logprobs):
        top = reference.logprobs[index].top
        if len(top) >= 2:
            margin = top[0][1] - top[1][1]
    assert margin is not None and margin < MARGIN_TOLERANCE, (
        f"{label}: outputs diverge at generated token {index} "
        f"({list(ref_ids)[index : index + 3]} vs {list(ids)[index : index + 3]}) with a top-2 "
        f"logit margin of {margin} (only < {MARGIN_TOLERANCE} is tolerated)"
    )
    print(f"{label}: diverged at token {index} with top-2 margin {margin:.2e} (tolerated)")
