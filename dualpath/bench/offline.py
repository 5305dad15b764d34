"""Offline (RL-rollout style) benchmark: N agents start together; JCT is when the last ends.

    dualpath bench offline --preset ci --modes basic,dualpath,oracle --json results/offline.json

For each mode a fresh one-host cluster (``LocalCluster``) with a fresh store replays the same
seeded multi-turn conversations: turn i+1's prompt is turn i's prompt, the tokens actually
generated, and a new append; every turn generates exactly ``gen_tokens`` (ignore_eos). Link
caps emulate a cluster's SNICs and CNICs on one host (SPEC §4), so every figure here depends
on the preset's caps, which the JSON records.

Per mode the JSON has ``jct_s``, ``tokens_per_s``, ``ttft_s`` percentiles, ``hit_ratio`` and
``path_bytes = {"pe": ..., "de": ...}``: hit-KV bytes read from the store by each side (split
reads count each part on its side). ``token_mismatches`` counts the turns whose tokens differ
from the first mode's: every mode must generate the same tokens.

``oracle`` removes every link cap and keeps its store on a memory file system (/dev/shm), so
every hit is served from memory: each mode starts from an empty store, so all the hit KV of a
run is written during the run, into memory (``store_in_memory`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dualpath.bench.hardware import hardware_info
from dualpath.cluster.launcher import LocalCluster
from dualpath.config import (
    MODES,
    READ_PATHS,
    ClusterConfig,
    EngineConfig,
    KVStoreConfig,
    TrafficConfig,
    mode_settings,
)
from dualpath.types import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OfflinePreset:
    num_agents: int
    num_turns: int
    first_prompt_tokens: int  # the first turn's context
    append_tokens: int  # appended per later turn (a tool result)
    gen_tokens: int  # generated per turn
    num_prefill_nodes: int
    num_decode_nodes: int
    # Emulated link caps (0 = real speed). Small, because the tiny model's KV is small.
    snic_bandwidth_gbps: float
    cnic_bandwidth_gbps: float
    description: str


PRESETS = {
    "ci": OfflinePreset(
        num_agents=4,
        num_turns=4,
        first_prompt_tokens=900,
        append_tokens=60,
        gen_tokens=16,
        num_prefill_nodes=1,
        num_decode_nodes=2,
        snic_bandwidth_gbps=0.2,
        cnic_bandwidth_gbps=0.0,
        description="4 agents x 4 turns on 1P2D with the tiny model; well under 2 minutes",
    ),
}


def make_conversation_seeds(preset: OfflinePreset, seed: int, vocab_size: int) -> list[dict]:
    """Each agent's first prompt and appends, from one seeded generator per agent."""
    root = np.random.SeedSequence(seed)
    agents = []
    for child in root.spawn(preset.num_agents):
        rng = np.random.default_rng(child)
        agents.append(
            {
                "first": rng.integers(0, vocab_size, preset.first_prompt_tokens).tolist(),
                "appends": [
                    rng.integers(0, vocab_size, preset.append_tokens).tolist()
                    for _ in range(preset.num_turns - 1)
                ],
            }
        )
    return agents


def run_mode(
    mode: str,
    preset: OfflinePreset,
    *,
    model_dir: Path,
    work_dir: Path,
    seed: int,
    vocab_size: int,
    transport: str = "nixl",
    read_path: str | None = None,
) -> dict:
    """Replay the preset's conversations on a fresh cluster in ``mode`` (``read_path`` forces
    one read path); the mode's results."""
    cluster_config = ClusterConfig(
        num_prefill_nodes=preset.num_prefill_nodes,
        num_decode_nodes=preset.num_decode_nodes,
        mode=mode,
        read_path=read_path,
        traffic=TrafficConfig(
            snic_bandwidth_gbps=preset.snic_bandwidth_gbps,
            cnic_bandwidth_gbps=preset.cnic_bandwidth_gbps,
        ),
    )
    params = SamplingParams(max_tokens=preset.gen_tokens, ignore_eos=True)
    agents = make_conversation_seeds(preset, seed, vocab_size)
    memory_dir = _memory_dir() if mode_settings(mode).is_io_free else None
    store_dir = (memory_dir or work_dir) / f"kv-{mode.replace('+', '-')}"
    try:
        result = _replay(
            mode, preset, cluster_config, params, agents, model_dir, store_dir, work_dir, transport
        )
    finally:
        if memory_dir is not None:
            shutil.rmtree(memory_dir, ignore_errors=True)
    result["store_in_memory"] = memory_dir is not None
    return result


def _memory_dir() -> Path | None:
    """A fresh directory on a memory file system, or None (with a warning) if there is none."""
    shm = Path("/dev/shm")
    if shm.is_dir() and any(
        line.split()[1:3] == ["/dev/shm", "tmpfs"]
        for line in Path("/proc/mounts").read_text().splitlines()
    ):
        return Path(tempfile.mkdtemp(prefix="dualpath-oracle-", dir=shm))
    logger.warning("no tmpfs at /dev/shm: the oracle's store stays on disk (page cache)")
    return None


def _replay(
    mode: str,
    preset: OfflinePreset,
    cluster_config: ClusterConfig,
    params: SamplingParams,
    agents: list[dict],
    model_dir: Path,
    store_dir: Path,
    work_dir: Path,
    transport: str,
) -> dict:
    with LocalCluster(
        cluster_config,
        model_dir=model_dir,
        store=KVStoreConfig(root_dir=store_dir),
        engine=EngineConfig(num_threads=1),
        transport=transport,
        log_dir=work_dir / f"logs-{mode.replace('+', '-')}",
    ) as cluster:
        contexts = [list(agent["first"]) for agent in agents]
        turns_done = [0] * len(agents)
        tokens: dict[str, list[int]] = {}  # "agent/turn" -> generated tokens
        in_flight = {cluster.submit(contexts[i], params): i for i in range(len(agents))}
        outputs = []
        start_s = time.monotonic()
        with tqdm(total=len(agents) * preset.num_turns, desc=f"{mode:>15}", unit="turn") as bar:
            while in_flight:
                request_id = next(iter(in_flight))
                agent = in_flight.pop(request_id)
                out = cluster.result(request_id, timeout_s=600)
                if out.error is not None:
                    raise RuntimeError(f"{mode}: agent {agent} failed: {out.error}")
                outputs.append((len(contexts[agent]), out))
                tokens[f"{agent}/{turns_done[agent]}"] = out.token_ids
                bar.update(1)
                turns_done[agent] += 1
                if turns_done[agent] < preset.num_turns:
                    append = agents[agent]["appends"][turns_done[agent] - 1]
                    contexts[agent] = contexts[agent] + out.token_ids + append
                    in_flight[cluster.submit(contexts[agent], params)] = agent
        jct_s = time.monotonic() - start_s
        link_bytes = cluster.coordinator.link_bytes()
        roles = {e: n.role.name for n in cluster.coordinator.topology.nodes for e in n.engine_ids}
    path_bytes = {"pe": 0, "de": 0}
    for engine_id, counters in link_bytes.items():
        side = "pe" if roles[engine_id] == "PREFILL" else "de"
        path_bytes[side] += counters.get("store_read_bytes", 0)
    prompt_tokens = sum(n for n, _ in outputs)
    cached_tokens = sum(o.num_cached_tokens for _, o in outputs)
    generated = sum(len(o.token_ids) for _, o in outputs)
    ttfts = [o.first_token_s - o.arrival_s for _, o in outputs if o.first_token_s is not None]
    return {
        "jct_s": jct_s,
        "num_requests": len(outputs),
        "tokens_per_s": (prompt_tokens - cached_tokens + generated) / jct_s,
        "generated_tokens_per_s": generated / jct_s,
        "hit_ratio": cached_tokens / prompt_tokens,
        "ttft_s": _percentiles(ttfts),
        "path_bytes": path_bytes,
        "link_bytes": {str(k): v for k, v in sorted(link_bytes.items())},
        "tokens": tokens,
    }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def run_offline(
    modes: list[str],
    preset_name: str,
    *,
    model_dir: Path,
    seed: int = 0,
    work_dir: Path | None = None,
    transport: str = "nixl",
    read_path: str | None = None,
) -> dict:
    from dualpath.model.config import ModelConfig

    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    preset = PRESETS[preset_name]
    vocab_size = ModelConfig.from_file(Path(model_dir) / "config.json").vocab_size
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-") as tmp:
        root = Path(work_dir or tmp)
        results = {
            mode: run_mode(
                mode,
                preset,
                model_dir=Path(model_dir),
                work_dir=root,
                seed=seed,
                vocab_size=vocab_size,
                transport=transport,
                read_path=read_path,
            )
            for mode in modes
        }
    first_tokens = results[modes[0]]["tokens"]
    for r in results.values():
        tokens = r.pop("tokens")
        r["token_mismatches"] = sum(tokens[k] != first_tokens.get(k) for k in tokens)
    report = {
        "benchmark": "offline",
        "preset": preset_name,
        "preset_config": asdict(preset),
        "seed": seed,
        "model_dir": str(model_dir),
        "transport": transport,
        "read_path": read_path,  # None: each mode's own
        "modes": results,
        "link_caps_emulated": preset.snic_bandwidth_gbps > 0 or preset.cnic_bandwidth_gbps > 0,
        "hardware": hardware_info(),
    }
    if "basic" in results:
        report["ratios"] = {
            f"{mode}_vs_basic_jct": results["basic"]["jct_s"] / r["jct_s"]
            for mode, r in results.items()
            if mode != "basic"
        }
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="ci", choices=sorted(PRESETS), help="workload + cluster"
    )
    parser.add_argument(
        "--modes",
        default="basic,dualpath,oracle",
        help=f"comma-separated modes to compare, in order (of {', '.join(MODES)})",
    )
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--transport", choices=("nixl", "shm"), default="nixl")
    parser.add_argument(
        "--read-path",
        choices=READ_PATHS,
        default=None,
        help="force one read path in every mode (default: each mode's own)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the result here")


def main(args: argparse.Namespace) -> int:
    from dualpath.cli import _resolve_model

    report = run_offline(
        [m.strip() for m in args.modes.split(",") if m.strip()],
        args.preset,
        model_dir=_resolve_model(args.model),
        seed=args.seed,
        transport=args.transport,
        read_path=args.read_path,
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{'mode':>15} {'JCT s':>8} {'tok/s':>8} {'hit':>6} {'PE read MB':>11} "
        f"{'DE read MB':>11} {'tokens':>9}"
    )
    for mode, r in report["modes"].items():
        same = "same" if r["token_mismatches"] == 0 else f"{r['token_mismatches']} differ"
        print(
            f"{mode:>15} {r['jct_s']:>8.2f} {r['tokens_per_s']:>8.0f} {r['hit_ratio']:>6.1%} "
            f"{r['path_bytes']['pe'] / 1e6:>11.2f} {r['path_bytes']['de'] / 1e6:>11.2f} "
            f"{same:>9}"
        )
    caps = report["preset_config"]
    print(
        f"link caps emulated: SNIC {caps['snic_bandwidth_gbps']} Gbps per node, "
        f"CNIC {caps['cnic_bandwidth_gbps'] or 'uncapped'}; seed {report['seed']}"
    )
    return 0
