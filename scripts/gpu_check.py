"""One prepared check for a machine with a CUDA GPU (about 5 minutes); `make gpu-check`.

    python scripts/gpu_check.py [--device cuda] [--json results/gpu_check.json]

1. transformers parity on the device: logits of the generated tiny model vs the reference;
2. the disaggregated engines on the device as `dualpath serve` runs them: a one-host cluster
   whose prefill and decode engine processes (layer-wise, hit KV staged in pinned host
   buffers) are joined through NIXL, tokens compared with the single-node engine on the CPU
   for the PE, DE and split read paths;
3. NIXL registration of device memory: a VRAM -> VRAM write between two agents;
4. a throughput figure: single-node prefill and decode tokens/s of the `small` preset;
5. vLLM as the engine, where this Python has vLLM (upstream's CUDA build on a GPU): `dualpath
   serve --engine vllm --nodes 1P1D` on the tiny model, its greedy tokens against plain vLLM's
   (its own `LLM`, no connector) cold and then warm from the store, through the page layout
   vLLM reports for its attention backend (``dualpath.vllm.layouts``). Skipped without vLLM.

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

    from dualpath.model.layerwise import PackedBatch
    from dualpath.model.loader import load_model

    ours = load_model(model_dir, device=device)
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(0)).to(device)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0].float()
    logits, _ = ours.model.forward_full(ids, PackedBatch((0,), (300,)), ours.model.empty_past())
    diff = (logits - expected).abs().max().item()
    return {"ok": diff < 1e-3, "max_abs_logit_diff": diff}


def step_disaggregated(device: str, model_dir: Path, work: Path) -> dict:
    """What ``dualpath serve --device DEVICE`` runs: a ``LocalCluster`` whose prefill and
    decode engines are their own processes (built from the configs it sends them), KV over
    NIXL, each read path forced in turn; tokens against the CPU single-node engine."""
    from dualpath import LLM, SamplingParams
    from dualpath.cluster.launcher import LocalCluster
    from dualpath.config import ClusterConfig, EngineConfig, KVStoreConfig

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
    results = {}
    for side in ("pe", "de", "split"):
        start = time.perf_counter()
        with LocalCluster(
            ClusterConfig(num_prefill_nodes=1, num_decode_nodes=1, read_path=side),
            model_dir=model_dir,
            store=KVStoreConfig(root_dir=store_dir),
            engine=EngineConfig(device=device, num_threads=1),
            log_dir=work / f"logs-{side}",
        ) as cluster:
            outs = cluster.generate(prompts, params)
        results[side] = {
            "identical_to_cpu_single_node": [
                out.token_ids == ref for out, ref in zip(outs, reference, strict=True)
            ],
            "num_cached_tokens": [out.num_cached_tokens for out in outs],
            "wall_s": time.perf_counter() - start,
        }
    ok = all(
        all(r["identical_to_cpu_single_node"]) and all(r["num_cached_tokens"])
        for r in results.values()
    )
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


# Plain vLLM's greedy tokens and top-2 logprobs, in a process of its own (vLLM is process-wide).
_PLAIN_VLLM = """
import json, sys
from vllm import LLM, SamplingParams
model, dtype, prompts, memory = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
llm = LLM(model, dtype=dtype, block_size=64, max_model_len=2048, enforce_eager=True, seed=0,
          enable_prefix_caching=False, gpu_memory_utilization=float(memory))
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2))
print(json.dumps([[list(o.outputs[0].token_ids),
                   [sorted((lp.logprob for lp in e.values()), reverse=True)[:2]
                    for e in o.outputs[0].logprobs]] for o in outs]))
"""


def step_vllm_serve(device: str, model_dir: Path, work: Path) -> dict:
    """``dualpath serve --engine vllm --nodes 1P1D`` against plain vLLM, cold then warm."""
    import importlib.util
    import os
    import socket
    import subprocess

    import httpx

    if importlib.util.find_spec("vllm") is None:
        return {"ok": None, "skipped": "this Python has no vLLM (pip install vllm)"}
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    memory = "0.25"  # of the GPU per vLLM engine: the server runs two
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (300, 1500)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    plain = subprocess.run(
        [sys.executable, "-c", _PLAIN_VLLM, str(model_dir), dtype, json.dumps(prompts), memory],
        capture_output=True, text=True, timeout=600, env=env, check=True,
    )  # fmt: skip
    reference = json.loads(plain.stdout.strip().splitlines()[-1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [
        sys.executable, "-m", "dualpath.cli", "serve", "--model", str(model_dir),
        "--engine", "vllm", "--nodes", "1P1D", "--dtype", dtype, "--port", str(port),
        "--served-model-name", "tiny",
        "--kv-store", str(work / "vllm-kv"), "--max-model-len", "2048",
        "--vllm-arg", f"gpu_memory_utilization={memory}",
    ]  # fmt: skip
    result: dict = {"dtype": dtype, "passes": {}}
    with open(work / "vllm-serve.log", "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            log_tail = (work / "vllm-serve.log").read_text()[-2000:]
            return {"ok": False, "error": f"the server did not become healthy: {log_tail}"}
        for label in ("cold", "warm"):
            outs = [
                httpx.post(
                    f"{url}/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                          "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                    timeout=600,
                ).json()
                for prompt in prompts
            ]  # fmt: skip
            result["passes"][label] = [
                _against_plain_vllm(out, ref) for out, ref in zip(outs, reference, strict=True)
            ]
    finally:
        server.terminate()
        server.wait(timeout=60)
    passes = result["passes"]
    result["ok"] = all(r["same_or_near_tie"] for p in passes.values() for r in p) and all(
        r["cached_tokens"] > 0 for r in passes["warm"]
    )
    return result


def _against_plain_vllm(out: dict, reference: list) -> dict:
    """One completion against plain vLLM's: the first difference only at a near tie of its
    top two tokens (bfloat16 rounding differs between a cached and an uncached prefill)."""
    tokens = out["choices"][0]["token_ids"]
    expected, tops = reference
    first = next(
        (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None
    )
    margin = None if first is None else tops[first][0] - tops[first][1]
    return {
        "same_or_near_tie": len(tokens) == len(expected) and (margin is None or margin < 0.05),
        "first_difference": first,
        "top2_margin": margin,
        "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
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
            "vllm_serve": lambda: step_vllm_serve(args.device, model_dir, work),
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
