"""MLA attention, expanded or absorbed: ``python -m dualpath.bench.mla_bench [--device cuda]``.

Times one dense DeepSeek layer (attention dominates) in the model's two attention computations
(``DeepseekDecoderModel.absorb``): *naive*, which expands every key's latent through
``kv_b_proj`` into per-head keys and values as transformers does, and *absorbed*, which folds
``kv_b_proj`` into the query and the output and attends over the latents as cached. Two
shapes, the two phases an engine runs: a decode step (8 sequences, 1 new token over 1,024
cached each) and a prefill chunk (1 sequence, 512 new tokens over 1,024 cached). V3's per-head
dims (latent 512, rope 64, nope 128, v 128) with 16 heads and hidden 2,048; random weights
(seed 0); float32 and bfloat16. Prints milliseconds per call, the ratio and the largest
difference between the two computations' outputs; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dualpath.bench.hardware import hardware_info
from dualpath.model.deepseek import DeepseekDecoderModel
from dualpath.model.deepseek_config import DeepseekConfig
from dualpath.model.layerwise import PackedBatch, PaddedPast
from dualpath.options import add_device_argument, add_json_argument

# (name, sequences, new tokens each, cached tokens each)
SHAPES = (("decode", 8, 1, 1024), ("prefill", 1, 512, 1024))


def _layer(device: str, dtype: torch.dtype) -> DeepseekDecoderModel:
    config = DeepseekConfig.from_dict(
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "vocab_size": 1024,
            "hidden_size": 2048,
            "intermediate_size": 4096,
            "num_hidden_layers": 1,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "first_k_dense_replace": 1,
            "q_lora_rank": 1536,
        }
    )
    gen = torch.Generator().manual_seed(0)
    model = DeepseekDecoderModel(config, device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model.to(device=device, dtype=dtype)


def time_shape(
    model: DeepseekDecoderModel,
    num_seqs: int,
    num_new: int,
    num_cached: int,
    *,
    num_repeats: int = 5,
) -> dict[str, float]:
    """Median seconds of one ``forward_layer`` call, naive and absorbed, and the largest
    difference between their outputs."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    gen = torch.Generator().manual_seed(1)
    dim = model.cache_entry_spec.dim
    cached = torch.randn(num_seqs, num_cached + 1, dim, generator=gen).to(device, dtype)
    hidden = torch.randn(num_seqs * num_new, model.config.hidden_size, generator=gen)
    hidden = hidden.to(device, dtype)
    batch = PackedBatch((num_cached,) * num_seqs, (num_new,) * num_seqs)
    rope = model.rope(batch.positions(device))

    def past():  # a decode step's padded scratch; a prefill chunk's per-sequence entries
        if num_new == 1:
            return PaddedPast(cached)
        return [cached[i, :num_cached] for i in range(num_seqs)]

    results: dict[str, float] = {}
    outputs = []
    with torch.inference_mode():
        for absorb in (False, True):
            model.absorb = absorb
            outputs.append(model.forward_layer(0, hidden, rope, batch, past())[0])
            times_s = []
            for _ in range(num_repeats):
                _synchronize(device)
                start = time.perf_counter()
                model.forward_layer(0, hidden, rope, batch, past())
                _synchronize(device)
                times_s.append(time.perf_counter() - start)
            results["absorbed_s" if absorb else "naive_s"] = statistics.median(times_s)
    results["naive_over_absorbed"] = results["naive_s"] / results["absorbed_s"]
    results["max_abs_diff"] = float((outputs[0].float() - outputs[1].float()).abs().max())
    return results


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(device: str) -> dict:
    report: dict = {"benchmark": "mla", "device": device, "hardware": hardware_info()}
    for dtype in (torch.float32, torch.bfloat16):
        model = _layer(device, dtype)
        for name, num_seqs, num_new, num_cached in SHAPES:
            figures = time_shape(model, num_seqs, num_new, num_cached)
            dtype_name = str(dtype).removeprefix("torch.")
            report[f"{name}_{dtype_name}"] = {
                "num_seqs": num_seqs,
                "num_new_tokens": num_new,
                "num_cached_tokens": num_cached,
                **figures,
            }
            print(
                f"{name:>7} {dtype_name:>8} ({num_seqs} x {num_new} new over {num_cached} "
                f"cached): naive {figures['naive_s'] * 1e3:8.2f} ms, absorbed "
                f"{figures['absorbed_s'] * 1e3:8.2f} ms, naive/absorbed "
                f"{figures['naive_over_absorbed']:5.2f}, max |diff| {figures['max_abs_diff']:.1e}"
            )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    add_json_argument(parser, what="the figures")
    args = parser.parse_args(argv)
    report = run(args.device)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
