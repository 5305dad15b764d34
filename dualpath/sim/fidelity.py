"""Fidelity to our own runtime: the ``local`` profile predicts a real ``dualpath bench offline``.

    dualpath simulate --experiment fidelity --reprofile     # profile, bench, simulate, compare
    dualpath simulate --experiment fidelity --bench-json results/offline-seed1.json

Steps (each a subprocess, so the simulator itself never imports torch):

1. with ``reprofile``, ``python -m dualpath.bench.sim_profile`` measures the engine's model
   and the serving path on this machine into a new ``local`` profile just before the
   benchmark (this machine's speed drifts by tens of percent over hours); otherwise the
   packaged ``dualpath/sim/local_profile.json`` is read;
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
import statistics
import subprocess
import sys
from pathlib import Path

from dualpath.sim.agents import AgentTrace, workload_agents
from dualpath.sim.local import (
    DEFAULT_PROFILE_PATH,
    load_local_profile,
    local_profile_from_dict,
    nonnegative_fit,
)
from dualpath.sim.runner import BLOCK_SIZE_TOKENS, RunSpec, run_simulation
from dualpath.units import gbps_to_bytes_per_s

logger = logging.getLogger(__name__)

FIDELITY_TOLERANCE = 0.15  # relative JCT error the issue allows
KV_CACHE_BYTES = 1e9  # ``dualpath serve --kv-cache-gb`` default (1 GB per engine)
# The probes' cluster has no SNIC cap and no hit to read; a finite rate keeps α finite.
UNCAPPED_BYTES_PER_S = 1e12


def simulate_alone(
    profile: dict, num_new: int, num_hit: int, num_output: int
) -> tuple[float, float]:
    """(TTFT, first token -> last token) of one request on an idle simulated 1P2D of
    ``profile``'s costs, every engine on a core of its own (nothing else runs)."""
    local = local_profile_from_dict(
        profile, snic_bytes_per_s=UNCAPPED_BYTES_PER_S, kv_cache_bytes=KV_CACHE_BYTES,
        num_engines=3, num_cores=3,
    )  # fmt: skip
    agent = AgentTrace(0, 0.0, (num_new + num_hit,), (num_hit,), (num_output,))
    spec = RunSpec(model="tiny", hardware="local", nodes="1P2D", num_agents=1, mode="dualpath",
                   agents=(agent,), local=local)  # fmt: skip
    record = run_simulation(spec).records[0]
    return record.first_token_s - record.submit_s, record.finish_s - record.first_token_s


def fit_serving(profile: dict, samples: list[list[float]]) -> dict[str, float]:
    """What the engine's model alone does not explain of the serving-path probes
    (``dualpath.bench.sim_profile``; samples ``[new, hit, output, ttft, decode, PE busy]``),
    measured on an idle cluster:

    * ``prefill_request_s`` + ``prefill_s_per_hit_token`` x hit: the PE's time in the batch
      (``/metrics``) beyond the forward's fit: assembling hit KV from the buffers, sending
      each layer's KV, sampling. PE time, so it queues other requests under load;
    * ``turn_latency_s``: the median of measured - simulated TTFT once those are in (the HTTP
      front end and the scheduler's messages before the first token reaches the client);
    * ``handoff_s``: the median of measured - simulated first -> last token time of the
      one-token requests (the PE -> DE hand-off and the final event's way back);
    * ``decode_loop_s``: the median over the longer requests of what is left per decode step
      (the engine process's loop around ``LLMEngine.step``: reports, token messages).

    Each is >= 0 (a negative median is reported as 0: the costs explain it all)."""
    base = local_profile_from_dict(
        profile, snic_bytes_per_s=UNCAPPED_BYTES_PER_S, kv_cache_bytes=KV_CACHE_BYTES,
        num_engines=1, num_cores=1,
    ).cost  # fmt: skip
    pe_excess = [busy - base.forward_s([(hit, new)]) for new, hit, *_, busy in samples]
    request_s, per_hit_s = nonnegative_fit([[1.0, hit] for _, hit, *_ in samples], pe_excess)
    fitted = {
        **profile,
        "serving": {"prefill_request_s": request_s, "prefill_s_per_hit_token": per_hit_s},
    }
    shapes = {(int(new), int(hit), int(out)) for new, hit, out, *_ in samples}
    simulated = {shape: simulate_alone(fitted, *shape) for shape in shapes}
    ttft_excess, handoff, per_step = [], [], []
    for new, hit, out, ttft, decode, _ in samples:
        sim_ttft, sim_decode = simulated[int(new), int(hit), int(out)]
        ttft_excess.append(ttft - sim_ttft)
        if out == 1:
            handoff.append(decode - sim_decode)
    handoff_s = max(0.0, statistics.median(handoff)) if handoff else 0.0
    for new, hit, out, _, decode, _ in samples:
        if out > 1:
            sim_decode = simulated[int(new), int(hit), int(out)][1]
            per_step.append((decode - sim_decode - handoff_s) / (out - 1))
    return {
        "prefill_request_s": request_s,
        "prefill_s_per_hit_token": per_hit_s,
        "turn_latency_s": max(0.0, statistics.median(ttft_excess)),
        "handoff_s": handoff_s,
        "decode_loop_s": max(0.0, statistics.median(per_step)) if per_step else 0.0,
        "simulated": [[*shape, round(t, 6), round(d, 6)] for shape, (t, d) in simulated.items()],
    }


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


def simulate_bench(bench: dict, profile_path: Path) -> dict[str, dict[str, float]]:
    """Simulated JCT, TTFT p50 and TPOT p50 per mode of a benchmark report, on the ``local``
    profile (the benchmark's definitions: TPOT over the tokens after the first)."""
    from dualpath.bench.presets import PRESETS, preset_workload

    preset = PRESETS[bench["preset"]]
    workload = preset_workload(preset, seed=bench["seed"], vocab_size=1024)
    agents = tuple(workload_agents(workload, block_size_tokens=BLOCK_SIZE_TOKENS))
    num_engines = sum(int(x) for x in preset.nodes.replace("D", "").split("P"))
    caps_gbps = bench.get("snic_caps_gbps") or preset.snic_bandwidth_gbps
    local = load_local_profile(
        profile_path,
        snic_bytes_per_s=gbps_to_bytes_per_s(caps_gbps) if caps_gbps else float("inf"),
        kv_cache_bytes=KV_CACHE_BYTES,
        num_engines=num_engines,
        num_cores=os.cpu_count() or 1,
    )
    simulated = {}
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
        result = run_simulation(spec)
        records = result.records
        tpots = [
            (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
            for r in records
            if r.num_output_tokens > 1
        ]
        simulated[mode] = {
            "jct_s": result.jct_s,
            "ttft_p50_s": statistics.median(r.first_token_s - r.submit_s for r in records),
            "tpot_p50_s": statistics.median(tpots) if tpots else 0.0,
        }
    return simulated


def read_bench_json(path: Path) -> dict:
    """A ``dualpath bench offline`` result; ``ValueError`` naming the file when it cannot be
    read or is not one."""
    try:
        bench = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"bench JSON {path}: cannot be read: {exc.strerror}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"bench JSON {path}: not JSON: {exc}") from exc
    if not isinstance(bench, dict) or not {"preset", "seed", "modes"} <= bench.keys():
        raise ValueError(
            f"bench JSON {path}: not a 'dualpath bench offline --json' result (no preset, seed "
            "and modes)"
        )
    return bench


def run_fidelity(
    *,
    work_dir: Path,
    bench_json: Path | None = None,
    profile_path: Path | None = None,
    reprofile: bool = False,
    preset: str = "ci",
    seed: int = 1,
    modes: tuple[str, ...] = ("basic", "dualpath"),
) -> list[dict]:
    """Measured and simulated JCT per mode: ``[{mode, measured_s, simulated_s, error}]``, with
    the p50 TTFT and TPOT beside them (``measured_ttft_p50_s``, ``simulated_ttft_p50_s``, ...)
    to show where an error comes from."""
    if profile_path is None:
        # A new profile goes into the work directory, never over the packaged one.
        profile_path = work_dir / "local_profile.json" if reprofile else DEFAULT_PROFILE_PATH
    work_dir.mkdir(parents=True, exist_ok=True)
    bench = None if bench_json is None else read_bench_json(bench_json)  # before profiling
    if reprofile or not profile_path.exists():
        profile_machine(profile_path)
    if bench is None:
        bench_json = work_dir / f"bench-offline-{preset}-seed{seed}.json"
        run_bench(bench_json, preset=preset, seed=seed, modes=list(modes))
        bench = read_bench_json(bench_json)
    simulated = simulate_bench(bench, profile_path)
    rows = []
    for mode, result in bench["modes"].items():
        measured_s = result["jct_s"]
        sim = simulated[mode]
        rows.append(
            {
                "mode": mode,
                "measured_s": measured_s,
                "simulated_s": sim["jct_s"],
                "error": sim["jct_s"] / measured_s - 1,
                "measured_ttft_p50_s": (result.get("ttft_s") or {}).get("p50"),
                "simulated_ttft_p50_s": sim["ttft_p50_s"],
                "measured_tpot_p50_s": (result.get("tpot_s") or {}).get("p50"),
                "simulated_tpot_p50_s": sim["tpot_p50_s"],
            }
        )
    return rows
