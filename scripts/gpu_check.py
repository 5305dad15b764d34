"""One prepared check for a machine with a CUDA GPU (about 5 minutes); `make gpu-check`.

    python scripts/gpu_check.py [--device cuda] [--json results/gpu_check.json]

1. transformers parity on the device: logits of the generated tiny model vs the reference;
2. the disaggregated engines on the device: a prefill engine (layer-wise, hit KV staged in
   pinned host buffers) and a decode engine joined through NIXL agents, tokens compared with
   the single-node engine on the CPU for the PE, DE and split read paths;
3. NIXL registration of device memory: a VRAM -> VRAM write between two agents;
4. a throughput figure: single-node prefill and decode tokens/s of the `small` preset.

With ``--device cpu`` it runs the same steps on the CPU (no VRAM step) so the script itself
can be checked anywhere. Every step records ok / error and its figures in the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


def step_parity(device: str, model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from dualpath.model.llama import PackedBatch
    from dualpath.model.loader import load_model

    ours = load_model(model_dir, device=device)
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(0)).to(device)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0].float()
    cfg = ours.config
    empty = torch.empty(0, cfg.num_kv_heads, cfg.head_dim, device=device)
    logits, _ = ours.model.forward_full(
        ids, PackedBatch((0,), (300,)), [[(empty, empty)]] * cfg.num_layers
    )
    diff = (logits - expected).abs().max().item()
    return {"ok": diff < 1e-3, "max_abs_logit_diff": diff}


def step_disaggregated(device: str, model_dir: Path, work: Path) -> dict:
    from dualpath import LLM, SamplingParams
    from dualpath.cluster.messages import Assignment
    from dualpath.config import EngineConfig, KVStoreConfig
    from dualpath.engine.buffers import KVBuffer
    from dualpath.engine.decode import DecodeEngine
    from dualpath.engine.llm import LLMEngine
    from dualpath.engine.prefill import PrefillEngine
    from dualpath.engine.remote_buffer import TransportRemoteBuffer, TransportStaging
    from dualpath.kv.hashing import block_keys
    from dualpath.kv.store import FileKVStore
    from dualpath.model.identity import kv_identity
    from dualpath.model.loader import load_model
    from dualpath.transfer.transport import create_transport
    from dualpath.types import sampling_params_to_dict

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    first = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (700, 1500)]
    store_dir = work / "kv"
    with LLM(model_dir, kv_store=store_dir) as llm:
        turn1 = llm.generate([{"prompt_token_ids": p} for p in first], params)
    prompts = [p + o.token_ids + [7] * 40 for p, o in zip(first, turn1, strict=True)]
    with LLM(model_dir) as llm:  # CPU, no store: the reference
        reference = [
            o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]

    loaded = load_model(model_dir, device=device)
    identity = kv_identity(loaded.config, loaded.weights_digest, "float32", 64)
    store = FileKVStore(store_dir, identity.layout, identity.fingerprint)
    results = {}
    for side, split in (("pe", lambda n: n), ("de", lambda n: 0), ("split", lambda n: n // 2)):
        pe_transport = create_transport("nixl", f"pe-{side}")
        de_transport = create_transport("nixl", f"de-{side}")
        prefill = PrefillEngine(
            loaded.model,
            identity,
            store,
            KVBuffer(identity.layout, 64 << 20, pin_memory=device == "cuda"),
            dtype=loaded.dtype,
            device=loaded.device,
            is_layerwise=True,
        )
        decode_engine = LLMEngine(
            loaded, EngineConfig(device=device), KVStoreConfig(root_dir=store_dir)
        )
        decode = DecodeEngine(
            decode_engine, KVBuffer(identity.layout, 64 << 20, pin_memory=device == "cuda")
        )
        descriptor = de_transport.register("de-buffer", decode.buffer.array)
        pe_transport.connect(f"de-{side}", de_transport.metadata())
        staging = TransportStaging(
            pe_transport, identity.layout, max_read_blocks=64, ring_blocks=64
        )
        remote = TransportRemoteBuffer(staging, f"de-{side}", descriptor, timeout_s=30.0)
        tokens = {}
        start = time.perf_counter()
        for request_id, prompt in enumerate(prompts):
            keys = block_keys(prompt[: (len(prompt) - 1) // 64 * 64], 64, identity.fingerprint)
            num_hit = store.lookup(keys)
            assignment = Assignment(
                request_id,
                tuple(prompt),
                sampling_params_to_dict(params),
                split(num_hit),
                num_hit - split(num_hit),
                0,
                1,
            )
            decode.add(assignment)
            prefill.add(assignment)
            tokens[request_id] = []
        pending = set(tokens)
        while pending:
            for ready in decode.poll_ready():
                prefill.on_decode_ready(ready)
            for done in prefill.step(lambda _, remote=remote: remote):
                tokens[done.request_id].append(done.first_token_id)
                decode.on_prefill_done(done)
            for update in decode.step():
                tokens[update.request_id] += update.token_ids
                if update.finish_reason is not None:
                    pending.discard(update.request_id)
        results[side] = {
            "identical_to_cpu_single_node": [
                tokens[i] == reference[i] for i in range(len(prompts))
            ],
            "wall_s": time.perf_counter() - start,
        }
        decode_engine.close()
        prefill.close()
        decode.close()
        pe_transport.close()
        de_transport.close()
    ok = all(all(r["identical_to_cpu_single_node"]) for r in results.values())
    return {"ok": ok, "paths": results}


def step_nixl_vram(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"ok": None, "skipped": "no CUDA device"}
    from dualpath.transfer.transport import Region, create_transport

    src = torch.arange(64 << 20, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    a, b = create_transport("nixl", "vram-a"), create_transport("nixl", "vram-b")
    src_desc, dst_desc = a.register("src", src), b.register("dst", dst)
    a.connect("vram-b", b.metadata())
    start = time.perf_counter()
    a.wait(a.write("vram-b", src_desc, dst_desc, [Region(0, 0, src.numel())]), timeout_s=30.0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    ok = bool(torch.equal(src, dst)) and src_desc.mem_type == "VRAM"
    a.close()
    b.close()
    return {"ok": ok, "mem_type": src_desc.mem_type, "gb_per_s": src.numel() / elapsed / 1e9}


def step_throughput(device: str, work: Path) -> dict:
    from dualpath import LLM, SamplingParams
    from dualpath.model.make import make_model

    model_dir = make_model("small", work / "small")
    with LLM(model_dir, device=device) as llm:
        prompts = [{"prompt_token_ids": [i % 1000] * 2048} for i in range(8)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
        decode_s = time.perf_counter() - start - prefill_s
    generated = sum(len(o.token_ids) for o in outs)
    return {
        "ok": True,
        "model": "small preset",
        "prefill_tokens_per_s": 8 * 2048 / prefill_s,
        "decode_tokens_per_s": generated / max(decode_s, 1e-9),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=Path("results/gpu_check.json"))
    args = parser.parse_args()
    from dualpath.model.make import make_model

    report: dict = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = make_model("tiny", work / "tiny")
        steps = {
            "parity": lambda: step_parity(args.device, model_dir),
            "disaggregated": lambda: step_disaggregated(args.device, model_dir, work),
            "nixl_vram": lambda: step_nixl_vram(args.device),
            "throughput": lambda: step_throughput(args.device, work),
        }
        for name, run in steps.items():
            start = time.perf_counter()
            try:
                result = run()
            except Exception as exc:  # a check script reports every step, whatever fails
                result = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
            result["wall_s"] = time.perf_counter() - start
            report["steps"][name] = result
            print(f"{name:>14}: {json.dumps(result)[:300]}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    failed = [n for n, r in report["steps"].items() if r.get("ok") is False]
    print(f"gpu-check: {'FAILED ' + ', '.join(failed) if failed else 'ok'} -> {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
