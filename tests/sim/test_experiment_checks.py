"""The experiments' checks: each recomputable from the JSON's ``runs``, and the paper's figures
at reduced size (``--scale-down 8``) for the checks ``test_paper_checks.py`` does not make.

``recomputed_checks`` reads only the run records an experiment writes to its JSON, so it
also shows a user how to recompute every ``ours`` from a results file. Misses at this size
are strict xfails carrying the figure (docs/simulator.md, "Known gaps"): a change that
mends one turns its test red until the mark goes.
"""

from __future__ import annotations

import functools
import json
import math
import random
import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest

from dualpath.sim import experiments, online
from dualpath.sim.cluster import RequestRecord
from dualpath.sim.experiments import V32, ExperimentResult
from dualpath.sim.online import OnlineProbe
from dualpath.sim.runner import RunSpec, map_runs, run_simulation

# Minutes of simulation from the sources: run by `make test-compiled` (compiled, in CI).
pytestmark = pytest.mark.paper

SCALE_DOWN = 8


def _jct_by_mode(runs: list[dict]) -> dict[str, float]:
    jct = {run["mode"]: run["jct_s"] for run in runs}
    assert len(jct) == len(runs), "one run per mode expected"
    return jct


def recomputed_checks(name: str, runs: list[dict]) -> dict[str, float]:
    """Every check of experiment ``name``, from its run records alone (as in ``--json``)."""
    checks: dict[str, float] = {}
    if name == "offline-jct":
        target = [
            r
            for r in runs
            if (r["model"], r["nodes"], r["max_len"]) == (V32, "2P4D", 65_536)
            and r["agents"] * r["scale_down"] == 2048
        ]
        jct = _jct_by_mode(target)
        prefix = "offline_660b_2p4d_64k_2048"
        checks[f"{prefix}_dualpath_over_basic"] = jct["basic"] / jct["dualpath"]
        checks[f"{prefix}_jct_dualpath_over_oracle"] = jct["dualpath"] / jct["oracle"]
        if target[0]["scale_down"] == 1:
            checks[f"{prefix}_dualpath_jct_s"] = jct["dualpath"]
    elif name == "ablation":
        jct = _jct_by_mode(runs)
        for mode in ("layerwise", "layerwise+dual", "dualpath"):
            checks[f"ablation_{mode}_jct_reduction_pct"] = 100 * (1 - jct[mode] / jct["basic"])
    elif name == "snic-balance":
        balance = {run["mode"]: run["snic_load_balance"] for run in runs}
        checks["snic_balance_scheduler"] = balance["dualpath"]
        checks["snic_balance_round_robin"] = balance["layerwise+dual"]
        attention = {run["mode"]: run["attention_balance"] for run in runs}
        if attention["dualpath"] is not None:  # None: one-GPU PE groups (--scale-down 8)
            checks["attention_balance_scheduler"] = attention["dualpath"]
    elif name == "pd-ratio":
        pairs: dict[tuple, dict[str, float]] = defaultdict(dict)
        for run in runs:
            pairs[run["nodes"], run["agents"]][run["mode"]] = run["jct_s"]
        checks["pd_ratio_mean_speedup"] = statistics.fmean(
            jct["basic"] / jct["dualpath"] for jct in pairs.values()
        )
    elif name == "scale":
        # Offline: the 2,048-agent run and its copies (the online searches' own offline runs
        # have fewer agents); online: the probes, each carrying its search's capacity.
        offline = [r for r in runs if "aps" not in r and r["agents"] * r["scale_down"] >= 2048]
        (small,) = [r for r in offline if r["nodes"] == "2P4D"]
        (big,) = [r for r in offline if r["nodes"] != "2P4D"]
        checks[f"scale_{big['nodes'].lower()}_over_2p4d_jct"] = big["jct_s"] / small["jct_s"]
        if small["scale_down"] == 1:
            checks["offline_660b_2p4d_64k_2048_dualpath_jct_s"] = small["jct_s"]
        online_capacity = {r["nodes"]: r["capacity_aps"] for r in runs if "aps" in r}
        (online_big,) = set(online_capacity) - {"2P4D"}
        ratio = online_capacity[online_big] / online_capacity["2P4D"]
        checks[f"scale_online_{online_big.lower()}_over_2p4d_capacity"] = ratio
    elif name == "online-capacity":
        capacity: dict[str, dict[str, float]] = defaultdict(dict)
        for run in runs:
            if "aps" in run:  # a probe; the offline and unloaded runs carry no capacity
                capacity[run["model"]][run["mode"]] = run["capacity_aps"]
        for model, by_mode in capacity.items():
            short = "660b" if model == V32 else model
            ratio = by_mode["dualpath"] / by_mode["basic"]
            checks[f"online_capacity_{short}_dualpath_over_basic"] = ratio
    return checks


def _assert_recomputable(result: ExperimentResult) -> None:
    recomputed = recomputed_checks(result.name, result.runs)
    assert sorted(recomputed) == sorted(check.name for check in result.checks)
    for check in result.checks:
        # Records round JCTs to 1 ms and SNIC balances to 1e-4.
        assert check.ours == pytest.approx(recomputed[check.name], rel=1e-4, abs=1e-4), check


# --- every experiment and grid, with made-up run results -------------------------------


@pytest.fixture
def fake_runs(monkeypatch):
    """``run_simulation`` and the online search replaced by draws from one seeded stream."""
    rng = random.Random(7)

    def fake_run(spec, **_):
        return SimpleNamespace(
            spec=spec,
            jct_s=rng.uniform(500.0, 9000.0),
            snic_load_balance=rng.uniform(1.0, 2.0),
            attention_balance=rng.choice([math.nan, rng.uniform(1.0, 2.0)]),
            num_requests=1,
            num_events=1,
            wall_s=1.0,
            events_per_s=1.0,
            records=[
                RequestRecord(0, i, 0.0, 1.0, 1.0, 2.0, 5) for i in range(rng.randint(1, 200))
            ],
        )

    def fake_find_capacity(spec, start_aps, window_s, copies=1, progress=False):
        probes = []
        for _ in range(rng.randint(2, online.MAX_PROBES)):
            aps = start_aps * rng.uniform(0.2, 4.0)
            probes.append(OnlineProbe(aps, 1, 1, rng.uniform(0.0, 8.0), 0.01, 1, 1.0))
        probes.append(OnlineProbe(start_aps * 0.1, 1, 1, 0.5, 0.01, 1, 1.0))  # one pass
        return probes

    monkeypatch.setattr(experiments, "run_simulation", fake_run)
    monkeypatch.setattr(online, "find_capacity", fake_find_capacity)


@pytest.mark.parametrize("name", sorted(experiments.EXPERIMENTS))
@pytest.mark.parametrize(("scale_down", "full"), [(1, False), (SCALE_DOWN, True)])
def test_every_check_is_recomputable_from_the_runs(fake_runs, name, scale_down, full):
    if (name, scale_down) == ("scale", 1) or (name, scale_down) == ("append-scaling", 1):
        scale_down = 4  # their workloads are generated for real: keep them small
    result = experiments.run_experiment(name, scale_down=scale_down, full=full)
    assert result.runs
    _assert_recomputable(result)


def test_all_experiments_in_one_command_share_runs_and_write_one_json_and_png(
    fake_runs, monkeypatch, tmp_path, capsys
):
    from dualpath.cli import main

    simulated, searched = [], []
    fake = experiments.run_simulation
    monkeypatch.setattr(
        experiments, "run_simulation", lambda spec, **kw: simulated.append(spec) or fake(spec)
    )
    fake_search = online.find_capacity
    monkeypatch.setattr(
        online,
        "find_capacity",
        lambda *search, **kw: searched.append(search) or fake_search(*search),
    )
    out_json, out_png = tmp_path / "all.json", tmp_path / "all.png"
    args = ["simulate", "--experiment", "all", "--scale-down", "8", "--no-progress"]
    assert main([*args, "--json", str(out_json), "--png", str(out_png)]) == 0
    data = json.loads(out_json.read_text())
    names = {run["experiment"] for run in data["runs"]}
    assert names == set(experiments.EXPERIMENTS)
    # offline-jct, ablation and scale all use the 2P4D 2,048-agent DualPath run: simulated
    # once, recorded by each.
    keys = [(spec, spec.agents) for spec in simulated]
    assert len(keys) == len(set(keys))
    # online-capacity's 660B DualPath search is also scale's 2P4D one: searched once.
    assert len(searched) == len(set(searched)) == 4 + 1
    shared = [r for r in data["runs"] if r["nodes"] == "2P4D" and r["mode"] == "dualpath"]
    shared = [r for r in shared if r["agents"] == 256 and r["experiment"] != "append-scaling"]
    assert sorted(r["experiment"] for r in shared) == ["ablation", "offline-jct", "scale"]
    for name in experiments.EXPERIMENTS:
        runs = [r for r in data["runs"] if r["experiment"] == name]
        recomputed = recomputed_checks(name, runs)
        for check in [c for c in data["checks"] if c["name"] in recomputed]:
            # As written: rounded to 1e-4.
            assert check["ours"] == pytest.approx(recomputed[check["name"]], rel=1e-4, abs=1e-4)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"of {len({check['name'] for check in data['checks']})} checks ok" in printed
    assert all(f"== {name} ==" in printed for name in experiments.EXPERIMENTS)


def test_the_recomputation_notices_a_wrong_ours(fake_runs):
    result = experiments.run_experiment("pd-ratio", scale_down=SCALE_DOWN)
    check = result.checks[0]
    result.checks[0] = experiments.Check(check.name, check.paper, check.ours * 1.01, 0.1)
    with pytest.raises(AssertionError):
        _assert_recomputable(result)


# --- worker processes (--jobs) -----------------------------------------------------------


def _without_timings(result: ExperimentResult) -> tuple[list[dict], list]:
    runs = [
        {k: v for k, v in r.items() if k not in ("wall_s", "events_per_s")} for r in result.runs
    ]
    return runs, result.checks


def test_jobs_give_the_same_runs_in_the_same_order_and_the_same_checks():
    # Compared with the reduced-size run below (two jobs), one run at a time here.
    alone = experiments.run_experiment("snic-balance", scale_down=SCALE_DOWN)
    assert _without_timings(alone) == _without_timings(_experiment("snic-balance"))


def test_a_failing_run_in_a_worker_fails_the_experiment_with_its_error():
    # The 660B's weights do not fit one 80 GB GPU (--scale-down 8 makes 1-GPU nodes).
    doomed = RunSpec(model=V32, nodes="1P1D", num_agents=64, preset="32k", scale_down=8)
    fine = RunSpec(model="27b", nodes="1P1D", num_agents=64, preset="32k", scale_down=8)
    with pytest.raises(ValueError, match="leave no KV memory"):
        map_runs(run_simulation, [(fine,), (doomed,)], jobs=2)
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        experiments._Runner(ExperimentResult("t"), None, jobs=0)


# --- the paper's figures at reduced size ------------------------------------------------


REDUCED = ("snic-balance", "pd-ratio", "scale", "online-capacity")


@functools.cache
def _reduced_results() -> dict[str, ExperimentResult]:
    # Two jobs: the CI machine's two cores (about 90 s from the sources instead of 150).
    results = experiments.run_experiments(REDUCED, scale_down=SCALE_DOWN, jobs=2)
    return {result.name: result for result in results}


def _experiment(name: str) -> ExperimentResult:
    return _reduced_results()[name]


def _ours(name: str, check_name: str) -> float:
    (check,) = [c for c in _experiment(name).checks if c.name == check_name]
    return check.ours


@pytest.mark.parametrize("name", REDUCED)
def test_the_reduced_runs_checks_are_recomputable_from_their_records(name):
    # Not inside the xfail tests below, where a failure would read as the expected miss.
    _assert_recomputable(_experiment(name))


def _miss(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"TODO(#7): {reason}")


# (experiment, check, SPEC §7's figure, the issue's tolerance), as the tests state them.
PAPER_AT_REDUCED_SIZE = [
    pytest.param("snic-balance", "snic_balance_round_robin", 1.53, 0.1, id="snic-round-robin"),
    pytest.param(
        "snic-balance",
        "snic_balance_scheduler",
        1.18,
        0.1,
        id="snic-scheduler",
        marks=_miss(
            "1.026 at this size (1.034 at full size): the 27B run is storage-saturated, "
            "every SNIC reads at its rate (docs/simulator-analysis.md, SNIC balance)"
        ),
    ),
    pytest.param(
        "pd-ratio",
        "pd_ratio_mean_speedup",
        1.64,
        0.15 * 1.64,
        id="pd-ratio",
        marks=_miss(
            "2.095x at this size (2.105x at full size): 1P2D's 2.85x, our 27B is more "
            "storage-bound than the paper's (docs/simulator-analysis.md)"
        ),
    ),
    # Table 3's 48P96D vs 2P4D, here 8P16D vs 2P4D (the default grid), 1-GPU nodes.
    pytest.param("scale", "scale_8p16d_over_2p4d_jct", 3201 / 3167, 0.05, id="scale"),
    pytest.param(
        "scale",
        "scale_online_8p16d_over_2p4d_capacity",
        4.0,
        0.4,
        id="scale-online",
        marks=_miss(
            "3.38x at this size (3.40x at full size; 4.00x with the quota per forward): "
            "a first turn's long lockstep step stalls one PE group while the agents served "
            "by the others keep placing turns on it (docs/simulator-analysis.md, Online scale)"
        ),
    ),
    pytest.param(
        "online-capacity",
        "online_capacity_660b_dualpath_over_basic",
        2.25,
        0.15 * 2.25,
        id="online-660b",
        marks=_miss(
            "1.85x at this size (1.17x at full size): lockstep prefill steps wait for a "
            "group's largest chunk under the per-layer quota (docs/simulator.md, Online capacity)"
        ),
    ),
    pytest.param(
        "online-capacity",
        "online_capacity_27b_dualpath_over_basic",
        1.67,
        0.15 * 1.67,
        id="online-27b",
        marks=_miss(
            "1.96x at this size against 1.80x (ok) at full size: the 1-GPU nodes of "
            "--scale-down 8 are not a neutral shrink (test_paper_checks.py)"
        ),
    ),
]


@pytest.mark.parametrize(("name", "check_name", "paper", "tolerance"), PAPER_AT_REDUCED_SIZE)
def test_the_paper_figure_holds_at_reduced_size(name, check_name, paper, tolerance):
    ours = _ours(name, check_name)
    assert abs(ours - paper) <= tolerance, ours


def test_the_attention_balance_holds_with_four_gpu_prefill_groups():
    # At --scale-down 8 the SNIC-balance run's PE group is one GPU (no balance to measure, no
    # check); at 2 it is four. SPEC §7: 1.06; 1.011 here, 1.021 at full size.
    result = experiments.run_experiment("snic-balance", scale_down=2, jobs=2)
    _assert_recomputable(result)
    assert "attention_balance_scheduler" not in recomputed_checks(
        "snic-balance", _experiment("snic-balance").runs
    )
    (check,) = [c for c in result.checks if c.name == "attention_balance_scheduler"]
    assert check.ok, check.ours
