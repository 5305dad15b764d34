"""The ``local`` profile's SNIC is the benchmark's emulated cap, one token bucket for reads and
writes: a DE's persistence writes are flows on its node's SNIC, count in the node's write_q
(which the read-side choice adds to read_q) and hold back the agent's next turn until they
land, as the runtime's scheduler waits for ``KVPersisted``."""

from __future__ import annotations

import json

import pytest

from dualpath.sim.agents import AgentTrace
from dualpath.sim.local import load_local_profile
from dualpath.sim.runner import RunSpec, build_simulator

BLOCK_BYTES = 64 * 2048  # a Full Block of the profile: 64 tokens x 2048 B
SNIC_BYTES_PER_S = 25e6
# Cheap attention, so that one batch holds every first turn (no chunking under the quota).
PROFILE = {
    "num_layers": 4,
    "kv_bytes_per_token": 2048,
    "prefill": {"fixed_s": 0.01, "per_new_token_s": 1e-5, "per_pair_s": 1e-10},
    "decode": {"fixed_s": 0.004, "per_seq_s": 5e-4, "per_context_token_s": 1e-6},
    "copy_bytes_per_s": 4e9,
}


def _simulate(tmp_path, agents, nodes="1P1D"):
    path = tmp_path / "local.json"
    path.write_text(json.dumps(PROFILE))
    local = load_local_profile(
        path, snic_bytes_per_s=SNIC_BYTES_PER_S, kv_cache_bytes=1e9, num_engines=1, num_cores=1
    )
    spec = RunSpec(model="tiny", hardware="local", nodes=nodes, num_agents=len(agents),
                   mode="dualpath", agents=tuple(agents), local=local)  # fmt: skip
    simulator = build_simulator(spec)
    simulator.run()
    return simulator


def test_a_next_turn_waits_for_its_writes_and_reads_on_the_idle_prefill_node(tmp_path):
    # Agent 0 writes a 100-block first turn (0.52 s at the cap); agent 1 writes 10 blocks,
    # then sends a turn that hits them. Both first turns end in one batch, so both writes
    # start together and share the DE node's SNIC: agent 1's end after ~2 x 52 ms. Its next
    # turn reaches the scheduler only then, while agent 0's blocks are still being written:
    # the DE node's read_q is 0 but its write_q is not, so the read goes to the PE node (with
    # read_q alone, a tie: the DE side, behind the writes).
    agents = [
        AgentTrace(0, 0.0, (6400,), (0,), (2,)),
        AgentTrace(1, 0.0, (640, 704), (0, 640), (2, 2)),
    ]
    simulator = _simulate(tmp_path, agents)
    prefill_node, decode_node = simulator.nodes
    # The PE node read agent 1's 10 hit blocks; the DE node's SNIC carried only the writes:
    # 100 + 10 blocks of first turns and the second turn's 1 new block.
    assert sum(prefill_node.snic_read.finished_bytes) == pytest.approx(10 * BLOCK_BYTES)
    assert sum(decode_node.snic_read.finished_bytes) == pytest.approx(111 * BLOCK_BYTES)
    assert sum(decode_node.snic_write.finished_bytes) == 0.0  # writes share the read link
    assert decode_node.write_queue_tokens == 0 and prefill_node.write_queue_tokens == 0
    first, second = sorted(
        (r for r in simulator.records if r.agent_index == 1), key=lambda r: r.turn_index
    )
    both_writes_s = 2 * 10 * BLOCK_BYTES / SNIC_BYTES_PER_S  # agent 1's end, sharing
    alone_read_s = 10 * BLOCK_BYTES / SNIC_BYTES_PER_S
    assert second.submit_s == first.finish_s  # the agent sends at once; TTFT counts the wait
    assert second.first_token_s > first.first_token_s + both_writes_s + alone_read_s
    # ... yet well before agent 0's 100 blocks are written (~0.58 s after the batch).
    assert second.first_token_s < first.first_token_s + 0.3


def test_without_writes_queued_a_tie_reads_on_the_decode_side(tmp_path):
    # One agent: its next turn waits for its own writes, so both nodes' queues are empty at
    # its placement and SPEC §6's tie rule reads it on the DE side.
    simulator = _simulate(tmp_path, [AgentTrace(0, 0.0, (640, 704), (0, 640), (2, 2))])
    prefill_node, decode_node = simulator.nodes
    assert sum(prefill_node.snic_read.finished_bytes) == 0.0
    assert sum(decode_node.snic_read.finished_bytes) == pytest.approx((10 + 10 + 1) * BLOCK_BYTES)
