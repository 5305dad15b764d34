"""The fetch driver (``scheduler/fetching.py``): when a woken group fetches, for the runtime and
the simulator alike."""

from __future__ import annotations

from dualpath.cluster.fetches import GroupFetches
from dualpath.cluster.group_load import GroupLoad
from dualpath.config import SchedulerConfig
from dualpath.scheduler import FetchDriver, make_cluster_topology, make_scheduler
from dualpath.sim.engines import PrefillGroup
from dualpath.sim.runner import build_simulator
from tests.sim.test_simulator import small_spec


class Group:
    def __init__(self, name: str, *, idle: bool) -> None:
        self.name = name
        self.idle = idle
        self.is_fetch_pending = False

    def is_idle(self) -> bool:
        return self.idle


def _driver(prefill, decode, *, fetch_when_idle=True):
    calls: list[tuple[str, str]] = []
    driver = FetchDriver(
        prefill,
        decode,
        fetch_when_idle=fetch_when_idle,
        fetch_now=lambda g: calls.append(("now", g.name)),
        fetch_at_tick=lambda g: calls.append(("tick", g.name)),
    )
    return driver, calls


def test_an_idle_group_fetches_at_once_and_a_busy_one_at_its_tick():
    idle, busy = Group("p0", idle=True), Group("p1", idle=False)
    driver, calls = _driver([idle, busy], [])
    driver.wake_prefill()
    assert calls == [("now", "p0"), ("tick", "p1")]
    assert idle.is_fetch_pending and busy.is_fetch_pending


def test_without_fetch_when_idle_every_group_waits_for_its_tick():
    idle = Group("d0", idle=True)
    driver, calls = _driver([], [idle], fetch_when_idle=False)
    driver.wake_decode()
    assert calls == [("tick", "d0")]
    assert not driver.fetches_at_once(idle)


def test_a_pending_fetch_is_asked_for_once_until_it_starts():
    group = Group("p0", idle=False)
    driver, calls = _driver([group], [])
    driver.wake_prefill()
    driver.wake_prefill()  # every PE group pending: nothing to wake
    driver.request_fetch(group)
    assert calls == [("tick", "p0")]
    driver.start_fetch(group, True)
    assert not group.is_fetch_pending
    driver.wake_prefill()
    assert calls == [("tick", "p0"), ("tick", "p0")]


def test_a_woken_group_that_becomes_idle_is_due_at_once():
    group = Group("d0", idle=False)
    driver, calls = _driver([], [group])
    driver.wake_decode()
    assert not driver.fetches_at_once(group)
    group.idle = True
    assert driver.fetches_at_once(group)
    driver.start_fetch(group, False)
    assert not driver.fetches_at_once(group)  # nothing pending any more


def test_the_simulator_and_the_runtime_run_this_driver():
    simulator = build_simulator(small_spec(nodes="2P4D", num_agents=4))
    assert isinstance(simulator._fetch_driver, FetchDriver)
    assert simulator._fetch_driver.prefill_groups == simulator.prefill_groups
    assert all(type(g) is PrefillGroup for g in simulator.prefill_groups)
    assert not simulator._fetch_driver.fetch_when_idle  # the paper's hardware: the grid only
    topology = make_cluster_topology(
        num_prefill_nodes=1, num_decode_nodes=2, storage_read_tokens_per_s=1000.0, nodes_per_group=1
    )
    policy = make_scheduler(SchedulerConfig(beta_tokens=10_000), topology)
    engine_id_to_node = {e: n.node_id for n in topology.nodes for e in n.engine_ids}
    fetches = GroupFetches(policy, topology, engine_id_to_node)
    assert isinstance(fetches.driver, FetchDriver) and fetches.driver.fetch_when_idle
    assert [type(g) for g in fetches.driver.decode_groups] == [GroupLoad] * 2
