"""A forwarded call placed again counts the store hits of each later placement apart from the
first's: each reads its hits again (the benchmark's hit-KV rule counts those reads)."""

from __future__ import annotations

import asyncio

from dualpath.protocol import Forward, RequestEvent
from dualpath.server.metrics import GenerationTimes
from dualpath.types import SamplingParams
from dualpath.vllm.router.forwarded_placements import Placements
from tests.server.test_metrics import make_metrics, samples, snapshot


class _Cluster:
    """Forwards each submission at once, with the next of ``hit_tokens`` as its store hits."""

    def __init__(self, hit_tokens: list[int]) -> None:
        self.hit_tokens = hit_tokens
        self.cancelled: list[int] = []

    def submit(self, prompt_token_ids, params, *, on_event, scope=None) -> int:
        request_id = len(self.cancelled) + 100
        forward = Forward(request_id, 0, 1, "", "http://de:8000")
        on_event(RequestEvent(1, (), None, self.hit_tokens.pop(0), forward=forward))
        return request_id

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)


def test_each_placement_made_again_counts_its_store_hits() -> None:
    async def place_three_times() -> Placements:
        placements = Placements(_Cluster([64, 32, 48]), servers=None, model=None)
        for _ in range(3):  # the first, then two made again after a loss
            await placements.place([1, 2, 3], SamplingParams(max_tokens=1))
        await placements.close(is_finished=True)
        return placements

    placements = asyncio.run(place_three_times())
    assert placements.num_placements == 3
    assert placements.num_cached_tokens == 64
    assert placements.num_replaced_hit_tokens == 80


def test_the_server_counts_them_beside_the_first_placements_store_hits() -> None:
    metrics = make_metrics([snapshot(0.0, 0, 0)])
    metrics.on_generation_finished(
        "length",
        GenerationTimes(10.0, 10.5, 10.75, 12.5, num_output_tokens=9),
        num_prompt_tokens=100,
        num_cached_tokens=64,
        num_replaced_hit_tokens=80,
    )
    values = samples(metrics)
    assert values[("dualpath_cached_prompt_tokens_total", ())] == 64
    assert values[("dualpath_replaced_hit_tokens_total", ())] == 80
