"""Prefill steps of the simulator: one lockstep step of a PE group, layer-wise or not.

``PrefillSteps`` holds ``Simulator``'s step methods (it is a base class of ``Simulator`` and
uses its state: the queue, the cost model, the requests in flight). A step takes every PE's
next ``PrefillBatcher`` batch and lasts as long as the slowest PE's compute:

* layer-wise (every mode but ``basic``): compute, the per-layer hit-KV loads and the MoE
  all-to-all run together; KV leaves for the DEs as layers complete;
* ``basic``: load the hit KV into HBM, then compute, then send to the DEs, one after another;
  HBM is freed when the sends are done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from dualpath.scheduler import AttentionTimePredictor, FetchDriver, PrefillBatch, PrefillChunk
from dualpath.sim.engines import EngineGroup, PrefillGroup, SimPrefillEngine, SimRequest
from dualpath.sim.events import EventPriority, EventQueue
from dualpath.sim.links import TrafficClass

# An Enum member looked up on its class costs ~0.2 us; a module constant a few ns (Final: the
# compiled build keeps it in a C static instead of looking it up in the module's dict).
_STEP_DONE: Final = EventPriority.STEP_DONE
_KV: Final = TrafficClass.KV
_INFERENCE: Final = TrafficClass.INFERENCE

if TYPE_CHECKING:
    from dualpath.config import ModeSettings
    from dualpath.sim.cluster import ClusterModel
    from dualpath.sim.cost import CostModel


class HbmCappedPredictor:
    """The batcher's predictor plus the PE's HBM limit: a batch whose KV (every token of every
    chunk, on ``num_layers_held`` layers) would not fit predicts over the quota. Monotone, so
    the unchanged ``PrefillBatcher`` packs under both limits."""

    __slots__ = ("_inner", "_bytes_per_token", "_capacity_bytes", "_over_s")

    def __init__(
        self,
        inner: AttentionTimePredictor,
        bytes_per_token: float,
        capacity_bytes: float,
        quota_s: float,
    ):
        self._inner = inner
        self._bytes_per_token = bytes_per_token
        self._capacity_bytes = capacity_bytes
        self._over_s = 2 * quota_s

    def predict_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        held_tokens = 0  # each chunk's cached + new tokens (a loop: compiled, it adds in C)
        for num_cached_tokens, num_new_tokens in chunks:
            held_tokens += num_cached_tokens + num_new_tokens
        time_s = self._inner.predict_s(chunks)
        if held_tokens * self._bytes_per_token > self._capacity_bytes:
            return time_s + self._over_s
        return time_s


class PrefillStep:
    """One lockstep step of a PE group: what it computes and what it still waits for."""

    __slots__ = ("group", "batches", "requests", "num_pending", "compute_s")

    def __init__(
        self,
        group: PrefillGroup,
        batches: list[tuple[SimPrefillEngine, PrefillBatch]],
        requests: dict[int, SimRequest],
    ):
        self.group = group
        self.batches = batches
        # The step's requests by id: one may finish decoding before the step ends (basic).
        self.requests = {
            chunk.request_id: requests[chunk.request_id]
            for _, batch in batches
            for chunk in batch.chunks
        }
        self.num_pending = 0  # parts (compute, flows) the current phase still waits for
        self.compute_s = 0.0


class PrefillSteps:
    """``Simulator``'s prefill-step methods (see the module docstring)."""

    # What the steps use of ``Simulator`` (which sets and defines them), declared here so the
    # methods type-check (and compile with mypyc) on their own.
    cluster: ClusterModel
    settings: ModeSettings
    queue: EventQueue
    _prefill_cost: CostModel
    _requests_in_flight: dict[int, SimRequest]
    _kv_bytes_per_token: int
    _block_size: int
    _num_waiting_prefill: int
    _fetch_driver: FetchDriver[EngineGroup]
    # Per lockstep step of a group of several PEs: its start, its slowest PE's attention time
    # (one layer) and the mean over the group's PEs, idle ones at 0 (SPEC §7's attention
    # balance in an EP group, ``metrics.attention_balance``).
    step_start_s: list[float]
    step_attention_max_s: list[float]
    step_attention_mean_s: list[float]

    def _on_kv_arrived(self, request: SimRequest) -> None:
        raise NotImplementedError

    def _start_step(self, group: PrefillGroup) -> None:
        batches = []
        for engine in group.engines:
            if engine.batcher.num_waiting:
                batch = engine.batcher.next_batch()
                if batch.chunks:
                    batches.append((engine, batch))
        if not batches:
            group.is_busy = False
            return
        step = PrefillStep(group, batches, self._requests_in_flight)
        cost = self._prefill_cost
        compute_s = 0.0
        attention_sum_s = 0.0
        attention_max_s = 0.0
        for _, batch in batches:
            pairs = [(c.num_cached_tokens, c.num_new_tokens) for c in batch.chunks]
            compute_s = max(compute_s, cost.prefill_s(pairs))
            attention_s = cost.attention_layer_s(pairs)
            attention_sum_s += attention_s
            attention_max_s = max(attention_max_s, attention_s)
        step.compute_s = compute_s
        num_engines = len(group.engines)
        if attention_sum_s > 0 and num_engines > 1:  # one PE is balanced by definition
            self.step_start_s.append(self.queue.now_s)
            self.step_attention_max_s.append(attention_max_s)
            self.step_attention_mean_s.append(attention_sum_s / num_engines)
        if self.settings.is_layerwise:
            self._run_layerwise_step(step)
        else:
            self._run_basic_load(step)

    def _hit_bytes(self, request: SimRequest) -> float:
        return request.num_hit_tokens * self._kv_bytes_per_token

    def _run_layerwise_step(self, step: PrefillStep) -> None:
        """Compute, per-layer hit loads and the MoE all-to-all run together; the step ends
        when the slowest PE's compute and every load are done. KV leaves for the DEs as each
        layer completes (flows that may outlast the step)."""
        requests = step.requests
        step.num_pending = 1
        for engine, batch in step.batches:
            load_bytes = 0.0
            num_new = 0
            for chunk in batch.chunks:
                request = requests[chunk.request_id]
                load_bytes += self._hit_bytes(request)
                num_new += chunk.num_new_tokens
                self._send_chunk(request, chunk, self._on_kv_arrived, request)
            if load_bytes:
                step.num_pending += 1
                engine.cnic.start(load_bytes, _KV, self._on_step_part_done, step)
            self._start_all_to_all(engine, num_new, step, self._on_step_part_done)
        self.queue.push(
            self.queue.now_s + step.compute_s,
            _STEP_DONE,
            self._on_step_part_done,
            step,
        )

    def _start_all_to_all(
        self,
        engine: SimPrefillEngine,
        num_new: int,
        step: PrefillStep,
        on_done: Callable[[PrefillStep], None],
    ) -> None:
        """The step's expert-parallel all-to-all on the engine's CNIC (inference class), if
        the model has one; ``on_done(step)`` when it ends."""
        if self.cluster.all_to_all_bytes_per_token and num_new:
            step.num_pending += 1
            engine.cnic.start(
                num_new * self.cluster.all_to_all_bytes_per_token,
                _INFERENCE,
                on_done,
                step,
            )

    def _send_chunk(
        self,
        request: SimRequest,
        chunk: PrefillChunk,
        on_done: Callable[[Any], None],
        token: Any,
    ) -> None:
        """PE -> DE buffer: the chunk's new KV, plus the PE-side hit blocks with the first
        chunk (DE-side hit blocks are already in the DE buffer). The DE's buffer -> HBM copy
        of the chunk's share of the prompt rides in the same flow on the DE's CNIC (both are
        RDMA writes into the DE GPU, SPEC §4); it is one flow per chunk instead of two."""
        bytes_per_token = self._kv_bytes_per_token
        num_bytes = 2 * chunk.num_new_tokens * bytes_per_token  # sent, then copied
        if chunk.num_cached_tokens == request.num_hit_tokens:
            num_bytes += (
                request.load_plan.num_prefill_side_blocks * self._block_size
                + request.num_hit_tokens  # the hit's copy into HBM
            ) * bytes_per_token
        request.num_pending_kv += 1
        request.decode_engine.cnic.start(num_bytes, _KV, on_done, token)

    def _on_step_part_done(self, step: PrefillStep) -> None:
        step.num_pending -= 1
        if step.num_pending == 0:
            self._finish_step(step)

    def _finish_step(self, step: PrefillStep) -> None:
        requests = step.requests
        now_s = self.queue.now_s
        fetch = False
        for engine, batch in step.batches:
            for chunk in batch.chunks:
                if chunk.is_last_chunk:
                    request = requests[chunk.request_id]
                    if request.first_token_s < 0:
                        request.first_token_s = now_s
                    engine.change_load(-1, -request.num_prompt_tokens)
                    fetch = True
                    if self.settings.is_layerwise:
                        self._on_kv_arrived(request)  # the prefill's own "+1"
        if fetch and self._num_waiting_prefill:
            self._fetch_driver.request_fetch(step.group)
        self.queue.push(now_s, _STEP_DONE, self._start_step, step.group)

    # basic: load -> compute -> send, one after another

    def _run_basic_load(self, step: PrefillStep) -> None:
        """Without layer-wise prefill every layer's hit KV of the batch is copied from the
        host buffer into HBM before the forward (the copy does not overlap compute)."""
        requests = step.requests
        step.num_pending = 0
        for engine, batch in step.batches:
            copy_bytes = sum(self._hit_bytes(requests[c.request_id]) for c in batch.chunks)
            step.num_pending += 1
            engine.cnic.start(copy_bytes, _KV, self._on_basic_loaded, step)

    def _on_basic_loaded(self, step: PrefillStep) -> None:
        step.num_pending -= 1
        if step.num_pending:
            return
        step.num_pending = 1
        for engine, batch in step.batches:
            num_new = sum(chunk.num_new_tokens for chunk in batch.chunks)
            self._start_all_to_all(engine, num_new, step, self._on_basic_computed)
        self.queue.push(
            self.queue.now_s + step.compute_s,
            _STEP_DONE,
            self._on_basic_computed,
            step,
        )

    def _on_basic_computed(self, step: PrefillStep) -> None:
        step.num_pending -= 1
        if step.num_pending:
            return
        requests = step.requests
        now_s = self.queue.now_s
        step.num_pending = 0
        for _, batch in step.batches:
            for chunk in batch.chunks:
                request = requests[chunk.request_id]
                if chunk.is_last_chunk:
                    request.first_token_s = now_s
                step.num_pending += 1
                self._send_chunk(request, chunk, self._on_basic_sent, (step, request))

    def _on_basic_sent(self, entry: tuple[PrefillStep, SimRequest]) -> None:
        """A send left the PE's HBM; the step ends (and frees HBM) when all of them have."""
        step, request = entry
        self._on_kv_arrived(request)
        step.num_pending -= 1
        if step.num_pending == 0:
            self._finish_step(step)
