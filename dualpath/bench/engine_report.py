"""``dualpath bench engine``'s report (``dualpath.bench.engine_bench`` measures): the result
JSON, its ratios against transformers, vLLM and the memory-bandwidth bound, the targets, and
the Markdown table."""

from __future__ import annotations

import statistics

from dualpath.bench.engine_bench import DEFAULT_ENGINES, EngineBenchConfig, Timing, Workload
from dualpath.bench.hardware import hardware_info, machine_line
from dualpath.model.identity import kv_facts

# The targets: (name, the ratio it judges, the least value that meets it).
TARGETS = (
    ("decode@1 ours / transformers", "decode@1", 1.0),
    ("decode@16 ours / transformers", "decode@16", 3.0),
    ("decode@1 ours / bandwidth bound", "decode@1_vs_bandwidth_bound", 0.5),
)
_COPY_METHOD = (
    "torch dst.copy_(src) of two {mib} MiB uint8 tensors on the benchmark's threads, allocated "
    "once and copied once untimed (page faults), then once per repeat; bytes/s = 2 * size "
    "(read + written) / time, median over repeats"
)


def build_report(
    config: EngineBenchConfig,
    shapes: list[Workload],
    samples: dict[tuple[str, str, str], list[Timing]],
    copy_samples_s: list[float],
    copy_size_bytes: int,
    weight_bytes: dict[str, int],
    model_config,
) -> dict:
    """The result JSON of ``run_engine_bench``: per dtype, each engine's tokens/s and spread,
    the ratios, whether tokens agree, the targets; ``copy_samples_s`` timed copies of
    ``copy_size_bytes`` give the memory-bandwidth bound."""
    import torch

    copy_bytes_per_s = 2 * copy_size_bytes / statistics.median(copy_samples_s)
    by_dtype = {
        dtype: _dtype_result(
            dtype,
            shapes,
            samples,
            weight_bytes[dtype],
            copy_bytes_per_s,
            config.batch_sizes,
            config.engines,
        )
        for dtype in config.dtypes
    }
    report = {
        "benchmark": "engine",
        "config": {
            "model_dir": str(config.model_dir),
            "architecture": model_config.architecture,
            "model": kv_facts(model_config),
            "dtypes": list(config.dtypes),
            "num_threads": config.num_threads,
            "prompt_tokens": config.prompt_tokens,
            "decode_prompt_tokens": config.decode_prompt_tokens,
            "decode_tokens": config.decode_tokens,
            "batch_sizes": list(config.batch_sizes),
            "num_repeats": config.num_repeats,
            "seed": config.seed,
            "engines": list(config.engines),
        },
        "hardware": hardware_info(
            torch=torch.__version__, transformers=_transformers_version(), **_vllm_version(config)
        ),
        "copy_bandwidth": {
            "method": _COPY_METHOD.format(mib=copy_size_bytes >> 20),
            "size_bytes": copy_size_bytes,
            "samples_s": copy_samples_s,
            "bytes_per_s": copy_bytes_per_s,
        },
        "results": by_dtype,
        "targets": [
            {
                "name": name,
                "dtype": dtype,
                "least": least,
                "measured": result["ratios"].get(ratio),
                "is_met": result["ratios"].get(ratio, 0.0) >= least,
            }
            for dtype, result in by_dtype.items()
            for name, ratio, least in TARGETS
            if ratio in result["ratios"]
        ],
    }
    if len(config.dtypes) > 1:
        report["dtype_ratios"] = _dtype_ratios(by_dtype, config.dtypes, config.engines)
    return report


def _vllm_version(config: EngineBenchConfig) -> dict[str, str]:
    if "vllm" not in config.engines:
        return {}
    from dualpath.vllm.bench.engine_bench import vllm_version

    return {"vllm": vllm_version()}


def _dtype_result(
    dtype: str,
    shapes: list[Workload],
    samples: dict[tuple[str, str, str], list[Timing]],
    weight_bytes: int,
    copy_bytes_per_s: float,
    batch_sizes: tuple[int, ...],
    engine_names: tuple[str, ...] = DEFAULT_ENGINES,
) -> dict:
    engines = {engine: _engine_result(samples, dtype, engine, shapes) for engine in engine_names}
    ours, theirs = engines["ours"]["tokens_per_s"], engines["transformers"]["tokens_per_s"]
    ratios = {name: ours[name] / theirs[name] for name in ours}
    bound = copy_bytes_per_s / weight_bytes
    if 1 in batch_sizes:
        ratios["decode@1_vs_bandwidth_bound"] = ours["decode@1"] / bound
    result = {
        "weight_bytes": weight_bytes,
        "bandwidth_bound_tokens_per_s": bound,
        **engines,
        "ratios": ratios,
        # Greedy tokens identical to transformers' in every repeat (a check on "same weights";
        # float rounding may part them where two logits nearly tie).
        "tokens_agree": _tokens_agree(samples, dtype, shapes, "transformers"),
    }
    if "vllm" in engines:
        vllm = engines["vllm"]["tokens_per_s"]
        result["ratios_vs_vllm"] = {name: ours[name] / vllm[name] for name in ours}
        result["tokens_agree_vllm"] = _tokens_agree(samples, dtype, shapes, "vllm")
    return result


def _tokens_agree(samples, dtype: str, shapes: list[Workload], other: str) -> dict[str, bool]:
    """Per workload: ours and ``other`` gave the same greedy tokens in every repeat."""
    return {
        w.name: all(
            a.token_ids == b.token_ids
            for a, b in zip(
                samples[dtype, "ours", w.name], samples[dtype, other, w.name], strict=True
            )
        )
        for w in shapes
    }


def _engine_result(
    samples: dict[tuple[str, str, str], list[Timing]], dtype: str, engine: str, shapes
) -> dict:
    tokens_per_s: dict[str, float] = {}
    raw: dict[str, dict[str, list[float]]] = {}
    for w in shapes:
        runs = samples[dtype, engine, w.name]
        raw[w.name] = {
            "prefill_s": [t.prefill_s for t in runs],
            "decode_s": [t.decode_s for t in runs],
        }
        if w.is_prefill:
            tokens_per_s[w.name] = w.prompt_tokens / statistics.median(raw[w.name]["prefill_s"])
        else:
            num_tokens = w.batch_size * (w.output_tokens - 1)
            tokens_per_s[w.name] = num_tokens / statistics.median(raw[w.name]["decode_s"])
    return {"tokens_per_s": tokens_per_s, "spread": _spread(raw), "samples": raw}


def _spread(raw: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Slowest / fastest repeat per workload: how much the machine moved under the variant."""
    spread = {}
    for name, timings in raw.items():
        times = timings["prefill_s" if name == "prefill" else "decode_s"]
        spread[name] = max(times) / min(times)
    return spread


def _dtype_ratios(
    by_dtype: dict[str, dict], dtypes: tuple[str, ...], engines: tuple[str, ...]
) -> dict[str, dict]:
    """Each later dtype's tokens/s over the first's, per engine and workload."""
    base = dtypes[0]
    return {
        f"{dtype}_vs_{base}": {
            engine: {
                name: value / by_dtype[base][engine]["tokens_per_s"][name]
                for name, value in by_dtype[dtype][engine]["tokens_per_s"].items()
            }
            for engine in engines
        }
        for dtype in dtypes[1:]
    }


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def markdown(report: dict) -> str:
    """The summary: tokens/s per dtype and engine, ratios, the bound and each target."""
    cfg, hw = report["config"], report["hardware"]
    engines = cfg.get("engines", DEFAULT_ENGINES)
    names = list(next(iter(report["results"].values()))["ours"]["tokens_per_s"])
    lines = [
        f"## engine · {cfg['architecture']} · {cfg['num_threads']} threads",
        machine_line(hw),
        "",
        f"prefill: {cfg['prompt_tokens']}-token prompt; decode: {cfg['decode_prompt_tokens']}"
        f"-token prompts, {cfg['decode_tokens']} output tokens, aggregate tokens/s from the "
        f"first token to the last; median of {cfg['num_repeats']}; seed {cfg['seed']}; "
        f"torch {hw['torch']}, transformers {hw['transformers']}"
        + (f", vLLM {hw['vllm']}" if "vllm" in hw else ""),
        "",
        "| dtype | engine | " + " | ".join(f"{n} tok/s" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for dtype, result in report["results"].items():
        for engine in engines:
            values = result[engine]["tokens_per_s"]
            lines.append(
                f"| {dtype} | {engine} | " + " | ".join(f"{values[n]:.1f}" for n in names) + " |"
            )
        for other, key in (("transformers", "ratios"), ("vllm", "ratios_vs_vllm")):
            if key in result:
                lines.append(
                    f"| {dtype} | ours / {other} | "
                    + " | ".join(f"{result[key][n]:.2f}x" for n in names)
                    + " |"
                )
    lines.append("")
    copy = report["copy_bandwidth"]
    for dtype, result in report["results"].items():
        lines.append(
            f"- {dtype}: weights {result['weight_bytes'] / 1e6:.1f} MB per token / copy "
            f"bandwidth {copy['bytes_per_s'] / 1e9:.2f} GB/s = bound "
            f"{result['bandwidth_bound_tokens_per_s']:.1f} tok/s at batch 1; greedy tokens "
            f"agree with transformers: "
            + ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in result["tokens_agree"].items())
            + (
                "; with vLLM: "
                + ", ".join(
                    f"{n} {'yes' if ok else 'no'}" for n, ok in result["tokens_agree_vllm"].items()
                )
                if "tokens_agree_vllm" in result
                else ""
            )
        )
    for key, engines in report.get("dtype_ratios", {}).items():
        for engine, values in engines.items():
            lines.append(
                f"- {engine} {key.replace('_vs_', ' / ')}: "
                + ", ".join(f"{n} {v:.2f}x" for n, v in values.items())
            )
    name, spread = max(
        (
            (f"{engine} {dtype} {n}", value)
            for dtype, result in report["results"].items()
            for engine in engines
            for n, value in result[engine]["spread"].items()
        ),
        key=lambda item: item[1],
    )
    lines.append(
        f"- repeats of one variant differed by up to {spread:.2f}x ({name}; slowest / fastest): "
        "the machine's load moved under the run by that much"
    )
    lines.append("")
    lines.append("| target | dtype | least | measured | |")
    lines.append("|---|---|---|---|---|")
    for t in report["targets"]:
        lines.append(
            f"| {t['name']} | {t['dtype']} | {t['least']:g} | {t['measured']:.2f} "
            f"| {'met' if t['is_met'] else 'missed'} |"
        )
    return "\n".join(lines) + "\n"
