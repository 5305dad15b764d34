"""``dualpath generate`` and ``dualpath demo``: one engine in this process, its KV from the
store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dualpath.cli.configs import resolve_block_size, store_config
from dualpath.flags import positive_int
from dualpath.home import default_kv_store_dir
from dualpath.model.default import resolve_model_dir
from dualpath.options import add_engine_arguments
from dualpath.vllm.args import engine_kind_args


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion on one engine, reusing KV from the store",
        description="Generate for one prompt on a single engine. The prompt's cached prefix "
        "is loaded from the KV store and every full block is persisted, so a later "
        "invocation whose prompt extends this one reuses its KV.",
    )
    add_engine_arguments(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="prompt as comma-separated token ids")
    _add_max_tokens_argument(p, default=16)
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence before this")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k best (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, num_prompt_tokens, num_cached_tokens, "
        "finish_reason and timings",
    )
    p.set_defaults(func=_run_generate)


def _build_llm(args: argparse.Namespace, model_dir: Path | None = None):  # -> LLM
    kv_store = None if args.no_kv_store else (args.kv_store or default_kv_store_dir())
    store = store_config(kv_store, args.kv_store_capacity_gb)
    model_dir = model_dir or resolve_model_dir(args.model)
    from dualpath.engine.llm import LLM  # lazy (torch): keeps --help and refusals fast

    return LLM(
        model_dir,
        kv_store=kv_store,
        kv_store_capacity_bytes=store.capacity_bytes,
        device=args.device,
        dtype=args.dtype,
        block_size=resolve_block_size(args.block_size, "native", model_dir),
        max_model_len=args.max_model_len,
        num_threads=args.threads,
    )


def _build_vllm_llm(args: argparse.Namespace):  # -> VllmLLM
    """``generate --engine vllm``: one vLLM engine in this process, with the store behind it."""
    from dualpath.vllm.args import check_vllm_device, check_vllm_installed

    kind = engine_kind_args(args)
    if kind["vllm_prefill_batching"] != "vllm":
        raise ValueError(
            "--vllm-prefill-batching is a prefill engine's (serve, engine): generate runs one "
            "engine that hands vLLM one request at a time"
        )
    check_vllm_device(args.device)
    check_vllm_installed()
    kv_store = None if args.no_kv_store else (args.kv_store or default_kv_store_dir())
    store = store_config(kv_store, args.kv_store_capacity_gb)
    model_dir = resolve_model_dir(args.model)
    from dualpath.vllm.llm import VllmLLM  # lazy: vLLM

    return VllmLLM(
        model_dir,
        kv_store=kv_store,
        kv_store_capacity_bytes=store.capacity_bytes,
        dtype=args.dtype,
        block_size=resolve_block_size(args.block_size, "vllm", model_dir),
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        vllm_args=kind["vllm_args"],
    )


def _refuse_vllm_engine(args: argparse.Namespace, command: str) -> None:
    if args.engine != "native" or args.vllm_arg or args.vllm_prefill_batching != "vllm":
        raise ValueError(
            f"{command} runs the native engine; --engine vllm serves with `dualpath serve`, "
            "`dualpath engine` or `dualpath generate`"
        )


def _add_max_tokens_argument(p: argparse.ArgumentParser, *, default: int) -> None:
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=default,
        help=f"tokens to generate per answer at most (default {default})",
    )


def _run_generate(args: argparse.Namespace) -> int:
    from dualpath.types import SamplingParams

    engine_kind_args(args)  # --vllm-arg without --engine vllm, or reserved ones: refused
    params = SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
    )
    build = _build_vllm_llm if args.engine == "vllm" else _build_llm
    with build(args) as llm:
        prompt = args.prompt if args.prompt is not None else {"prompt_token_ids": args.prompt_ids}
        out = llm.generate([prompt], params)[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "prompt_token_ids": out.prompt_token_ids,
                    "num_prompt_tokens": out.num_prompt_tokens,
                    "num_cached_tokens": out.num_cached_tokens,
                    "finish_reason": out.finish_reason,
                    "ttft_s": out.ttft_s,
                    "e2e_s": out.finish_s - out.arrival_s,
                    "load_s": out.load_s,
                }
            )
        )
    else:
        print(out.text)
        print(
            f"[{out.num_prompt_tokens} prompt tokens, {out.num_cached_tokens} from the KV store, "
            f"{len(out.token_ids)} generated, finish: {out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="a short coding-agent conversation on the embedded default, with its KV reuse",
        description="Replay a short coding-agent conversation on the model (default: the "
        "embedded SmolLM2-135M-Instruct) through its chat template: each turn sends the whole "
        "conversation so far plus the next message, as an agent does, and reports the answer and "
        "how much of the prompt's KV came from the store.",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--turns",
        type=positive_int,
        default=4,
        help=f"turns to run, <= {len(DEMO_TURNS)} (default 4)",
    )
    _add_max_tokens_argument(p, default=48)
    p.set_defaults(func=_run_demo)


DEMO_SYSTEM = "You are a coding agent. Answer in one or two short sentences."
DEMO_TURNS = (
    "The test suite fails in test_cache.py. Which command shows the failure?",
    "$ pytest -q tests/test_cache.py\nFAILED test_evict_order - assert [3, 1] == [1, 3]\n"
    "What does this failure tell us?",
    "$ sed -n 40,44p cache.py\n    def evict(self, n: int) -> list[int]:\n"
    "        victims = sorted(self._lru)[:n]\n        return victims\nWhat is wrong here?",
    "$ git diff\n-        victims = sorted(self._lru)[:n]\n+        victims = list(self._lru)[:n]\n"
    "$ pytest -q\n12 passed in 0.41s\nSummarize the fix for the commit message.",
)


def _run_demo(args: argparse.Namespace) -> int:
    from dualpath.server.chat import ChatRenderer
    from dualpath.types import SamplingParams

    _refuse_vllm_engine(args, "demo")
    if args.turns > len(DEMO_TURNS):
        raise ValueError(f"--turns must be <= {len(DEMO_TURNS)}, got {args.turns}")
    model_dir = resolve_model_dir(args.model)
    chat = ChatRenderer.for_checkpoint(model_dir)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    messages = [{"role": "system", "content": DEMO_SYSTEM}]
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hit':>6} {'ttft_ms':>8}  answer")
    with _build_llm(args, model_dir) as llm:
        for turn, text in enumerate(DEMO_TURNS[: args.turns]):
            messages.append({"role": "user", "content": text})
            prompt = llm.tokenizer.encode(chat.render(messages))
            out = llm.generate({"prompt_token_ids": prompt}, params)[0]
            answer = llm.tokenizer.decode(
                [t for t in out.token_ids if t not in llm.engine.eos_token_ids]
            ).strip()
            messages.append({"role": "assistant", "content": answer})
            hit = out.num_cached_tokens / out.num_prompt_tokens
            print(
                f"{turn + 1:>4} {out.num_prompt_tokens:>7} {out.num_cached_tokens:>7} "
                f"{hit:>6.1%} {1000 * (out.ttft_s or 0):>8.1f}  {answer.replace(chr(10), ' ')}"
            )
    return 0
