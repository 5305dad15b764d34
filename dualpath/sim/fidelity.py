"""Fidelity to our own runtime: the ``local`` profile predicts a real ``dualpath bench offline``.

    dualpath simulate --experiment fidelity                 # profile, bench, simulate, compare
    dualpath simulate --experiment fidelity --bench-json results/offline-seed1.json

Steps (each a subprocess, so the simulator itself never imports torch):

1. ``python -m dualpath.bench.sim_profile`` measures the engine's model on this machine and
   writes the ``local`` profile (skipped when the profile file exists and ``reprofile`` is
   off);
2. ``dualpath bench offline --preset ci --seed 1 --modes basic,dualpath`` runs the real
   cluster (skipped with ``--bench-json``: an earlier result is read instead);
3. the same workload (the preset's trajectories for that seed) is simulated on the profile,
   with the benchmark's SNIC caps and the engines' KV cache, and the JCT errors are reported.

The profile comes from microbenchmarks only, never from a benchmark run, so the benchmark is
a prediction whatever its seed; seed 1 keeps it apart from the benchmarks' default seed 0.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from dualpath.sim.agents import workload_agents
from dualpath.sim.local import DEFAULT_PROFILE_PATH, load_local_profile
from dualpath.sim.runner import RunSpec, run_simulation
from dualpath.units import gbps_to_bytes_per_s

logger = logging.getLogger(__name__)

FIDELITY_TOLERANCE = 0.15  # relative JCT error the issue allows
KV_CACHE_BYTES = 1e9  # ``dualpath serve --kv-cache-gb`` default (1 GB per engine)


def profile_machine(path: Path) -> None:
    """Run the microbenchmarks (``dualpath.bench.sim_profile``) into ``path``."""
    command = [sys.executable, "-m", "dualpath.bench.sim_profile", "--json", str(path)]
    logger.info("profiling: %s", " ".join(command))
    subprocess.run(command, check=True)


def run_bench(path: Path, *, preset: str, seed: int, modes: list[str]) -> None:
    """The real offline benchmark (``dualpath bench offline``), its JSON into ``path``."""
    command = [
        sys.executable, "-m", "dualpath.cli", "bench", "offline",
        "--preset", preset, "--seed", str(seed), "--modes", ",".join(modes),
        "--json", str(path),
    ]  # fmt: skip
    logger.info("benchmark: %s", " ".join(command))
    subprocess.run(command, check=True)


def simulate_bench(bench: dict, profile_path: Path) -> dict[str, float]:
    """Simulated JCT per mode of a benchmark report, on the ``local`` profile."""
    from dualpath.bench.presets import PRESETS, preset_workload

    preset = PRESETS[bench["preset"]]
    workload = preset_workload(preset, seed=bench["seed"], vocab_size=1024)
    agents = tuple(workload_agents(workload, block_size_tokens=64))
    num_engines = sum(int(x) for x in preset.nodes.replace("D", "").split("P"))
    caps_gbps = bench.get("snic_caps_gbps") or preset.snic_bandwidth_gbps
    local = load_local_profile(
        profile_path,
        snic_bytes_per_s=gbps_to_bytes_per_s(caps_gbps) if caps_gbps else float("inf"),
        kv_cache_bytes=KV_CACHE_BYTES,
        num_engines=num_engines,
        num_cores=os.cpu_count() or 1,
    )
    jct_s = {}
    for mode in bench["modes"]:
        spec = RunSpec(
            model="tiny",
            hardware="local",
            nodes=preset.nodes,
            num_agents=len(agents),
            mode=mode,
            agents=agents,
            local=local,
        )
        jct_s[mode] = run_simulation(spec).jct_s
    return jct_s


def run_fidelity(
    *,
    work_dir: Path,
    bench_json: Path | None = None,
    profile_path: Path = DEFAULT_PROFILE_PATH,
    reprofile: bool = False,
    preset: str = "ci",
    seed: int = 1,
    modes: tuple[str, ...] = ("basic", "dualpath"),
) -> list[dict]:
    """Measured and simulated JCT per mode: ``[{mode, measured_s, simulated_s, error}]``."""
    if reprofile or not profile_path.exists():
        profile_machine(profile_path)
    if bench_json is None:
        work_dir.mkdir(parents=True, exist_ok=True)
        bench_json = work_dir / f"bench-offline-{preset}-seed{seed}.json"
        run_bench(bench_json, preset=preset, seed=seed, modes=list(modes))
    bench = json.loads(bench_json.read_text())
    simulated = simulate_bench(bench, profile_path)
    rows = []
    for mode, result in bench["modes"].items():
        measured_s = result["jct_s"]
        rows.append(
            {
                "mode": mode,
                "measured_s": measured_s,
                "simulated_s": simulated[mode],
                "error": simulated[mode] / measured_s - 1,
            }
        )
    return rows
