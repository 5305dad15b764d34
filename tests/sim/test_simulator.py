"""The simulator end to end on tiny clusters with the constant cost model."""

from __future__ import annotations

import gc
import json
import math
import pickle
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

import dualpath.scheduler as scheduler_package
from dualpath.config import MODES
from dualpath.sim import simulator as simulator_module
from dualpath.sim.agents import AgentTrace, synthetic_agents
from dualpath.sim.cost import ConstantCostModel
from dualpath.sim.experiments import run_record
from dualpath.sim.metrics import attention_balance
from dualpath.sim.runner import RunSpec, build_simulator, run_simulation

CONSTANT = ConstantCostModel(
    prefill_s_per_new_token=2e-4,
    prefill_s_per_step=0.01,
    decode_s_per_step=0.02,
    decode_s_per_seq=1e-4,
)


def small_spec(**overrides) -> RunSpec:
    """A small 2P4D run with the constant cost model; other sim tests share it."""
    base = dict(
        model="deepseek-v3.2-660b",
        nodes="2P4D",
        num_agents=64,
        preset="32k",
        mode="dualpath",
        scale_down=8,
        constant_cost=CONSTANT,
    )
    base.update(overrides)
    return RunSpec(**base)


@pytest.mark.parametrize("mode", MODES)
def test_every_request_completes_once_and_bytes_are_conserved(mode):
    simulator = build_simulator(small_spec(mode=mode))
    simulator.run()
    expected = {(a.agent_id, t) for a in simulator.agents for t in range(a.num_turns)}
    seen = [(r.agent_index, r.turn_index) for r in simulator.records]
    assert len(seen) == len(set(seen)) == len(expected)
    assert set(seen) == expected
    for record in simulator.records:
        assert record.submit_s <= record.first_token_s <= record.decode_start_s <= record.finish_s
    # Storage reads: every hit block is read exactly once, through one side or the other.
    block_bytes = 64 * simulator.cluster.kv_bytes_per_token
    planned = sum(sum(a.hit_tokens) for a in simulator.agents) // 64 * block_bytes
    read = sum(sum(node.snic_read.finished_bytes) for node in simulator.nodes)
    assert read == (0 if mode == "oracle" else planned) or mode == "oracle"
    if mode != "oracle":
        assert read == pytest.approx(planned)
    for node in simulator.nodes:
        assert node.snic_read.num_flows == 0 and node.read_queue_tokens == 0
    for engine in simulator.engines.values():
        assert engine.num_seqs == 0 and engine.num_tokens == 0
    assert simulator.scheduler.num_waiting_prefill == simulator.scheduler.num_waiting_decode == 0


def test_basic_reads_only_on_prefill_nodes_and_dualpath_uses_both():
    basic = build_simulator(small_spec(mode="basic"))
    basic.run()
    prefill_nodes = {n.node_id for n in basic.cluster.topology.nodes if n.role == 0}
    for node in basic.nodes:
        if node.node_id not in prefill_nodes:
            assert sum(node.snic_read.finished_bytes) == 0
    dual = build_simulator(small_spec(mode="dualpath"))
    dual.run()
    decode_read = sum(
        sum(n.snic_read.finished_bytes) for n in dual.nodes if n.node_id not in prefill_nodes
    )
    assert decode_read > 0


def test_a_forced_read_path_decides_which_snics_read():
    one_turn_hit = AgentTrace(0, 0.0, (1000, 1100), (0, 960), (10, 10))

    def read_bytes(read_path: str) -> tuple[float, float]:
        simulator = build_simulator(
            small_spec(
                model="27b",
                nodes="1P1D",
                num_agents=1,
                scale_down=1,
                read_path=read_path,
                agents=(one_turn_hit,),
            )
        )
        simulator.run()
        prefill_node, decode_node = simulator.nodes
        return sum(prefill_node.snic_read.finished_bytes), sum(decode_node.snic_read.finished_bytes)

    hit_bytes = 960 * build_simulator(small_spec(model="27b")).cluster.kv_bytes_per_token
    assert read_bytes("pe") == (pytest.approx(hit_bytes), 0.0)
    assert read_bytes("de") == (0.0, pytest.approx(hit_bytes))
    on_pe, on_de = read_bytes("split")  # 15 blocks: both sides read some
    assert on_pe > 0 and on_de > 0 and on_pe + on_de == pytest.approx(hit_bytes)
    with pytest.raises(ValueError, match="read_path must be one of"):
        small_spec(read_path="sideways")


def test_same_seed_same_json_and_a_different_seed_differs():
    first = run_record("t", run_simulation(small_spec()))
    second = run_record("t", run_simulation(small_spec()))
    other = run_record("t", run_simulation(small_spec(seed=1)))
    for record in (first, second, other):
        record.pop("wall_s")
        record.pop("events_per_s")
    assert json.dumps(first) == json.dumps(second)
    assert first["jct_s"] != other["jct_s"]


@pytest.mark.parametrize("until_s", [math.inf, 37.0])
def test_a_run_with_progress_reports_is_the_same_run(until_s):
    # Progress slices the event loop; every record, the event count and the finish times
    # are those of one uninterrupted run, offline and stopped (an online probe).
    plain = build_simulator(small_spec())
    plain.run(until_s)
    sliced = build_simulator(small_spec())
    reports: list[tuple[float, int]] = []
    sliced.run(until_s, lambda now_s, done: reports.append((now_s, done)))
    assert sliced.records == plain.records and sliced.records
    assert sliced.queue.num_events == plain.queue.num_events
    assert sliced.agent_finish_s == plain.agent_finish_s
    assert len(sliced.requests_in_flight) == len(plain.requests_in_flight)
    assert len(reports) >= 3
    assert reports == sorted(reports) and reports[-1] == (sliced.queue.now_s, len(plain.records))
    if until_s == math.inf:
        assert reports[-1][1] == sliced.num_turns  # every turn of every agent
    else:
        assert reports[-1][0] <= until_s and plain.requests_in_flight


def test_run_records_carry_the_latency_percentiles_the_benchmark_reports():
    result = run_simulation(small_spec())
    record = run_record("t", result)
    ttfts = np.array([r.first_token_s - r.submit_s for r in result.records])
    many = [r for r in result.records if r.num_output_tokens > 1]
    tpots = np.array([(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in many])
    for q in (50, 90, 99):
        assert record["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q), abs=1e-6)
        assert record["tpot_s"][f"p{q}"] == pytest.approx(np.percentile(tpots, q), abs=1e-6)
    # The constant model decodes a token every 10 ms; the PE -> DE hand-off comes on top.
    assert record["tpot_s"]["p50"] >= 0.01 and record["ttft_s"]["p50"] > 0


def test_specs_and_results_survive_pickling_for_worker_processes():
    # --jobs sends specs to workers and results back; the compiled build's frozen classes
    # need their own __reduce__ for that (make test-compiled runs this against them).
    spec = small_spec()
    result = run_simulation(spec)
    again = pickle.loads(pickle.dumps(result))
    assert again.spec == spec and again.spec.constant_cost == spec.constant_cost
    assert again.spec.factors == spec.factors and again.records == result.records
    assert again.jct_s == result.jct_s


def test_two_simulators_in_one_process_are_independent():
    alone = run_simulation(small_spec()).jct_s
    a = build_simulator(small_spec())
    b = build_simulator(small_spec(mode="basic"))
    a.queue.run(until_s=5.0)  # interleave the two
    b.queue.run(until_s=5.0)
    a.run()
    b.run()
    assert max(a.agent_finish_s) == alone


def test_the_scheduler_package_is_used_unchanged():
    # The simulator drives the very classes dualpath.scheduler exports; nothing re-implements
    # placement, read-path choice or batching.
    simulator = build_simulator(small_spec(mode="dualpath"))
    assert type(simulator.scheduler) is scheduler_package.DualPathScheduler
    engine = next(e for e in simulator.engines.values() if hasattr(e, "batcher"))
    assert type(engine.batcher) is scheduler_package.PrefillBatcher
    assert simulator_module.make_scheduler is scheduler_package.make_scheduler
    basic = build_simulator(small_spec(mode="basic"))
    assert type(basic.scheduler) is scheduler_package.RoundRobinScheduler


def test_placements_equal_the_scheduler_driven_directly_on_the_same_snapshots():
    """Record every snapshot the simulator hands the scheduler, replay them on a fresh
    scheduler built from the same config: the answers are identical."""
    simulator = build_simulator(small_spec(mode="dualpath", num_agents=32))
    calls = []
    real = simulator.scheduler

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def submit(self, request):
            calls.append(("submit", request, None))
            real.submit(request)

        def fetch_prefill(self, snapshot):
            result = real.fetch_prefill(snapshot)
            calls.append(("fetch_prefill", snapshot, result))
            return result

        def fetch_decode(self, snapshot):
            result = real.fetch_decode(snapshot)
            calls.append(("fetch_decode", snapshot, result))
            return result

    simulator.scheduler = Recorder()
    simulator.run()
    fresh = scheduler_package.make_scheduler(
        simulator.cluster.scheduler, simulator.cluster.topology
    )
    num_fetches = 0
    for kind, argument, result in calls:
        if kind == "submit":
            fresh.submit(argument)
        else:
            num_fetches += 1
            assert getattr(fresh, kind)(argument) == result
    assert num_fetches > 10


def test_decode_steps_are_hand_computable_with_the_constant_model():
    # One agent, one turn: prompt 640 (no hit), 11 output tokens -> prefill of 640 new tokens
    # = 0.01 + 640 * 2e-4 = 0.138 s; then 10 decode steps of 0.02 + 1e-4 s.
    agent = AgentTrace(0, 0.0, (640,), (0,), (11,))
    result = run_simulation(small_spec(mode="oracle", agents=(agent,)))
    record = result.records[0]
    assert record.first_token_s - record.submit_s == pytest.approx(0.01 + 0.01 + 0.138, abs=0.011)
    assert record.finish_s - record.decode_start_s == pytest.approx(10 * 0.0201)


def test_attention_balance_is_the_busiest_pe_over_the_group_mean_in_the_first_steps():
    # One agent's turns, one at a time, in a lockstep group of G PEs: each step has one busy
    # PE and G - 1 idle (attention 0), so its max / mean is G. A one-PE group has no balance
    # to measure.
    agent = AgentTrace(0, 0.0, (640,) * 40, (0,) * 40, (2,) * 40)
    for scale_down, group_size in ((8, 2), (4, 4)):
        result = run_simulation(small_spec(agents=(agent,), scale_down=scale_down))
        assert result.attention_balance == pytest.approx(group_size)
    alone = run_simulation(small_spec(nodes="1P2D", agents=(agent,), model="27b"))
    assert math.isnan(alone.attention_balance)
    assert run_record("t", alone)["attention_balance"] is None
    # Only steps that start in the first ``until_s`` count (SPEC §7: the first 5%).
    # Steps weigh by their length: (2 + 4) / (1 + 1), the third starting too late to count.
    starts, maxima, means = [0.0, 1.0, 10.0], [2.0, 4.0, 8.0], [1.0, 1.0, 1.0]
    assert attention_balance(starts, maxima, means, until_s=5.0) == 3.0
    assert attention_balance(starts, maxima, means, until_s=20.0) == pytest.approx(14 / 3)
    assert math.isnan(attention_balance(starts, maxima, means, until_s=0.0))


def test_sim_imports_no_torch():
    code = (
        "import sys, dualpath.sim.runner, dualpath.sim.experiments, dualpath.sim.plan, "
        "dualpath.sim.online, dualpath.sim.fidelity, dualpath.sim.local; "
        "sys.exit(3 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_hits_are_whole_blocks_below_the_prompt():
    for agent in synthetic_agents("32k", 4, seed=0, block_size_tokens=64):
        assert agent.hit_tokens[0] == 0
        for prompt, hit in zip(agent.prompt_tokens, agent.hit_tokens, strict=True):
            assert hit % 64 == 0 and hit < prompt


class _FetchRecorder:
    """Wraps the simulator's scheduler: records every fetch as (time_s, kind, snapshot,
    result) and passes everything through unchanged."""

    def __init__(self, simulator):
        self.real = simulator.scheduler
        self.queue = simulator.queue
        self.fetches = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def fetch_prefill(self, snapshot):
        result = self.real.fetch_prefill(snapshot)
        self.fetches.append((self.queue.now_s, "prefill", snapshot, result))
        return result

    def fetch_decode(self, snapshot):
        result = self.real.fetch_decode(snapshot)
        self.fetches.append((self.queue.now_s, "decode", snapshot, result))
        return result


@pytest.mark.parametrize("mode", ["basic", "dualpath"])
def test_cached_snapshots_report_the_engines_and_nodes_as_they_are(mode):
    # The simulator reuses engine snapshots until an engine's load changes: every report must
    # still equal one built from the engines' and nodes' counts at that instant.
    simulator = build_simulator(small_spec(mode=mode, num_agents=32))
    recorder = simulator.scheduler = _FetchRecorder(simulator)
    engines, nodes = simulator.engines, {n.node_id: n for n in simulator.nodes}

    def check(snapshot):
        for reported in snapshot.engines:
            engine = engines[reported.engine_id]
            assert (reported.num_seqs, reported.num_tokens, reported.num_free_kv_blocks) == (
                engine.num_seqs,
                engine.num_tokens,
                engine.num_free_kv_blocks,
            )
        for reported in snapshot.nodes:
            assert reported.read_queue_tokens == nodes[reported.node_id].read_queue_tokens

    real_prefill, real_decode = recorder.fetch_prefill, recorder.fetch_decode
    recorder.fetch_prefill = lambda snapshot: (check(snapshot), real_prefill(snapshot))[1]
    recorder.fetch_decode = lambda snapshot: (check(snapshot), real_decode(snapshot))[1]
    simulator.run()
    assert len(recorder.fetches) > 10


def test_a_run_makes_no_garbage_cycles_and_restores_the_collector():
    # Simulator.run switches the cyclic garbage collector off while it runs: sound only
    # because the run leaves no reference cycles behind (nothing for a collection to free).
    simulator = build_simulator(small_spec(nodes="4P4D", num_agents=32))
    gc.collect()
    simulator.run()
    assert gc.isenabled()
    assert gc.collect() == 0
    gc.disable()
    try:
        build_simulator(small_spec(num_agents=4)).run()
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()


# PE costs that keep the PEs over β (Algorithm 1's gate) much of the run.
SLOW_PREFILL = ConstantCostModel(
    prefill_s_per_new_token=2e-2,
    prefill_s_per_step=0.01,
    decode_s_per_step=0.02,
    decode_s_per_seq=1e-4,
)


@pytest.mark.parametrize("mode", ["basic", "dualpath"])
def test_the_simulators_waiting_counts_are_the_schedulers(mode):
    # The simulator counts the requests waiting for a PE and for a DE from the fetches'
    # answers instead of asking the scheduler (its counts sum one queue per group): before
    # every fetch both agree.
    simulator = build_simulator(
        small_spec(mode=mode, nodes="4P4D", num_agents=64, constant_cost=SLOW_PREFILL)
    )
    recorder = simulator.scheduler = _FetchRecorder(simulator)
    real = recorder.real

    def check():
        assert simulator._num_waiting_prefill == real.num_waiting_prefill
        assert simulator._num_waiting_decode == real.num_waiting_decode

    real_prefill, real_decode = recorder.fetch_prefill, recorder.fetch_decode
    recorder.fetch_prefill = lambda snapshot: (check(), real_prefill(snapshot))[1]
    recorder.fetch_decode = lambda snapshot: (check(), real_decode(snapshot))[1]
    simulator.run()
    assert len(recorder.fetches) > 10


def _records_and_fetches(spec: RunSpec, kind: str, **switches: bool) -> tuple[list, int]:
    """One run with the simulator's ``switches`` (a result-identical cut on or off) set: its
    records and how many ``kind`` ("prefill" / "decode") fetches reached the scheduler."""
    simulator = build_simulator(spec)
    for name, value in switches.items():
        assert hasattr(simulator, name), name  # a misspelt switch would change nothing
        setattr(simulator, name, value)
    recorder = simulator.scheduler = _FetchRecorder(simulator)
    simulator.run()
    return simulator.records, sum(1 for f in recorder.fetches if f[1] == kind)


def test_the_prefill_fetches_left_out_change_nothing():
    # A PE group whose last fetch placed nothing from a non-empty FIFO (every PE over β) does
    # not fetch again while its PEs' loads are unchanged and no request of its waits for a DE
    # (Simulator._fetch_prefill). The run is the same bit for bit as one that makes every
    # such fetch, with a third fewer PE fetches here.
    spec = small_spec(nodes="4P4D", num_agents=64, constant_cost=SLOW_PREFILL)
    records, num_fetches = _records_and_fetches(spec, "prefill", _skips_full_prefill_groups=True)
    every_records, every_num_fetches = _records_and_fetches(
        spec, "prefill", _skips_full_prefill_groups=False
    )
    assert records == every_records
    assert num_fetches < 0.8 * every_num_fetches
    # The round-robin scheduler places by turn, not by load: it never skips.
    basic = build_simulator(replace(spec, mode="basic"))
    assert not basic._skips_full_prefill_groups


@pytest.mark.parametrize("mode", ["basic", "dualpath"])
def test_the_decode_fetches_left_out_change_nothing(mode):
    # A DE fetch that could place nothing (the scheduler's decode_fetch_may_place) sends only
    # its load (report_decode_load; Simulator._fetch_decode): the run is the same bit for bit
    # as one that makes every fetch.
    spec = small_spec(mode=mode, nodes="4P8D", num_agents=64, constant_cost=SLOW_PREFILL)
    records, num_fetches = _records_and_fetches(spec, "decode", _skips_idle_decode_fetches=True)
    every_records, every_num_fetches = _records_and_fetches(
        spec, "decode", _skips_idle_decode_fetches=False
    )
    assert records == every_records
    assert num_fetches < every_num_fetches


def test_prefill_groups_fetch_at_staggered_phases():
    # 2P1D: two one-node PE groups, phases 0 and 5 ms of the 10 ms interval; the DE group
    # stays on the common grid. One request submitted at 0: group 1 fetches first (5 ms) and
    # takes it, although group 0 comes first in the topology.
    agent = AgentTrace(0, 0.0, (640,), (0,), (11,))
    simulator = build_simulator(small_spec(model="27b", nodes="2P1D", agents=(agent,)))
    recorder = simulator.scheduler = _FetchRecorder(simulator)
    simulator.run()
    [(time_s, _, snapshot, result)] = [f for f in recorder.fetches if f[1] == "prefill"]
    assert time_s == pytest.approx(0.005)
    group_1 = simulator.prefill_groups[1]
    assert snapshot.group_id == group_1.group_id
    assert result.prefill_engine_ids == (group_1.engines[0].engine_id,)
    [phase_0, phase_1] = [group.fetch_phase_s for group in simulator.prefill_groups]
    assert (phase_0, phase_1) == (0.0, pytest.approx(0.005))
    assert all(group.fetch_phase_s == 0.0 for group in simulator.decode_groups)
    decode_times_ms = [round(f[0] * 1000, 6) for f in recorder.fetches if f[1] == "decode"]
    assert decode_times_ms and all(t % 10 == 0 for t in decode_times_ms)


def test_an_attention_quota_override_reaches_the_prefill_batchers():
    # dualpath simulate --attention-quota-s: SPEC §6's 300 ms unless a run says otherwise; a
    # quota far below one chunk's attention cuts batches into chunked prefill, so it shows.
    default = build_simulator(small_spec())
    tight = build_simulator(small_spec(attention_quota_s=1e-4))
    assert default.cluster.scheduler.attention_quota_s == 0.3
    assert tight.cluster.scheduler.attention_quota_s == 1e-4
    default.run()
    tight.run()
    assert len(tight.records) == len(default.records)
    assert max(tight.agent_finish_s) > max(default.agent_finish_s)
    with pytest.raises(ValueError, match="attention_quota_s"):
        small_spec(attention_quota_s=0.0)


def test_the_front_end_admits_turns_one_after_another():
    # hopper-8x400 / 8 admits 1,250 turns/s: 0.8 ms each, in the order they were sent. Five
    # agents start together; their first turns reach the scheduler 0.8 ms apart, and every
    # later turn at least 0.8 ms after its agent sent it.
    simulator = build_simulator(small_spec(num_agents=40))
    assert len(simulator.agents) == 5
    assert simulator._frontend_s_per_request == pytest.approx(0.0008)
    admitted = []  # (reaches the scheduler, sent by the agent)
    scheduler = simulator.scheduler

    class RecordingScheduler:  # (a wrapper: a mypyc-compiled scheduler's methods are fixed)
        def __getattr__(self, name):
            return getattr(scheduler, name)

        def submit(self, request):
            sent_s = simulator._requests_in_flight[request.request_id].submit_s
            admitted.append((simulator.queue.now_s, sent_s))
            scheduler.submit(request)

    simulator.scheduler = RecordingScheduler()
    simulator.run()
    assert [t for t, _ in admitted[:5]] == pytest.approx([0.0008 * i for i in range(1, 6)])
    assert all(t >= sent_s + 0.0008 - 1e-12 for t, sent_s in admitted)
    assert [t for t, _ in sorted(admitted, key=lambda a: a[1])] == sorted(t for t, _ in admitted)
    # TTFT counts from the agent's send, so it includes the wait at the front end.
    assert all(r.submit_s == 0.0 for r in simulator.records if r.turn_index == 0)
    assert len(admitted) == len(simulator.records)
    # A RunSpec (dualpath simulate --frontend-rps) overrides the profile's rate, before the
    # scale-down like every cluster-wide figure; the rate must be positive.
    slower = build_simulator(small_spec(num_agents=40, frontend_requests_per_s=500.0))
    assert slower._frontend_s_per_request == pytest.approx(8 / 500.0)
    with pytest.raises(ValueError, match="frontend_requests_per_s"):
        small_spec(frontend_requests_per_s=0.0)


def test_a_send_made_inline_changes_nothing_but_the_event_count():
    # With a front end, a finished turn's next send is made inside the decode finish instead
    # of as an event at the same instant: the front end's order is the sends' order either
    # way, so every record is the same, with one event fewer per turn.
    def run(inline: bool):
        simulator = build_simulator(small_spec(nodes="4P4D", num_agents=64))
        simulator._sends_reach_scheduler_later = inline
        simulator.run()
        return simulator.records, simulator.queue.num_events

    records, num_events = run(inline=True)
    evented_records, evented_num_events = run(inline=False)
    assert records == evented_records
    num_later_turns = sum(1 for r in records if r.turn_index)
    assert evented_num_events - num_events == num_later_turns


def test_agents_that_start_together_reach_every_prefill_group():
    # 8P16D at scale-down 8: four PE groups, and β lets one group take all 32 first turns in
    # one fetch. Admitted one after another, the turns reach the groups' staggered fetches
    # (2.5 ms apart) a few at a time and every group gets some; all at one instant, the
    # first group to fetch takes them all and the others idle (docs/simulator-analysis.md, "Scale").
    def groups_with_first_turns(frontend_s_per_request: float | None) -> set[int]:
        simulator = build_simulator(small_spec(nodes="8P16D", num_agents=256))
        if frontend_s_per_request is not None:
            simulator._frontend_s_per_request = frontend_s_per_request
        recorder = simulator.scheduler = _FetchRecorder(simulator)
        simulator.run(until_s=0.05)
        return {
            snapshot.group_id
            for _, kind, snapshot, result in recorder.fetches
            if kind == "prefill" and result.request_ids
        }

    assert len(groups_with_first_turns(None)) == 4
    assert len(groups_with_first_turns(0.0)) == 1


def test_the_append_is_persisted_at_decode_start_and_the_output_as_it_fills():
    # One turn, no hit: a prompt of 640 tokens (10 Full Blocks) and 181 output tokens, so
    # 640 + 180 tokens have KV: 2 output blocks. The append's 10 blocks are written when the
    # prompt KV is complete at the DE; the output's 2 spread evenly over the 180 decode steps.
    agent = AgentTrace(0, 0.0, (640,), (0,), (181,))
    simulator = build_simulator(small_spec(mode="dualpath", agents=(agent,)))
    simulator.run()
    [record] = simulator.records
    block_bytes = 64 * simulator.cluster.kv_bytes_per_token
    [writes] = [n.snic_write for n in simulator.nodes if sum(n.snic_write.finished_bytes)]
    assert sum(writes.finished_bytes) == pytest.approx(12 * block_bytes)
    start_s, end_s = record.decode_start_s, record.finish_s
    assert 0 < start_s < 1 < 3 < end_s < 4  # the decode spans windows 0 to 3
    output_rate = 2 * block_bytes / (end_s - start_s)
    expected = [
        10 * block_bytes + output_rate * (1 - start_s),
        output_rate,
        output_rate,
        output_rate * (end_s - 3),
    ]
    assert writes.window_bytes == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["basic", "dualpath"])
def test_a_ticks_decode_fetches_run_as_their_own_events_would(mode):
    # The DE fetches of one tick wait outside the event heap and run back to back while each
    # is the queue's next event (Simulator._fetch_at_tick): the same records and the
    # same number of events as with one heap event per fetch.
    spec = small_spec(mode=mode, nodes="4P8D", num_agents=64, constant_cost=SLOW_PREFILL)

    def run(batches: bool) -> tuple[list, int]:
        simulator = build_simulator(spec)
        simulator._batches_decode_ticks = batches
        simulator.run()
        return simulator.records, simulator.queue.num_events

    assert run(batches=True) == run(batches=False)
