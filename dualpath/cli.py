"""The ``dualpath`` command: the only place that reads argv and the environment.

    dualpath make-model --preset tiny --out DIR
    dualpath generate --prompt "Hello" --max-tokens 16 [--json]
    dualpath demo
    dualpath serve [--model DIR] [--port 8000]    # OpenAI-compatible API on a one-host cluster
    dualpath bench store | scheduler ...

Set ``DUALPATH_HOME`` to move the default data directory (models and KV store), which is
``~/.cache/dualpath`` otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from dualpath import __version__
from dualpath.errors import DualPathError
from dualpath.flags import non_negative_float, non_negative_int, positive_float, positive_int
from dualpath.transfer.transport import TRANSPORT_KINDS
from dualpath.units import gb_to_bytes
from dualpath.vllm_args import add_engine_kind_arguments, engine_kind_args

DEFAULT_PRESET = "tiny"  # the random-weight preset of make-model and the benchmarks

logger = logging.getLogger(__name__)


def data_home() -> Path:
    return Path(os.environ.get("DUALPATH_HOME") or Path.home() / ".cache" / "dualpath")


def tiny_model_dir() -> Path:
    return data_home() / "models" / DEFAULT_PRESET


def default_kv_store_dir() -> Path:
    return data_home() / "kv"


# Without --kv-store-capacity-gb the store may fill this fraction of its file system's free
# space at start: any client can send unique prompts, and an unbounded cache fills the disk.
DEFAULT_STORE_FREE_SPACE_FRACTION = 0.25


def store_config(root_dir: Path | None, capacity_gb: float | None):  # -> KVStoreConfig
    """The store's config from the flags; ``ValueError`` naming the flag for a bad budget, a
    budget without a store, or a ``root_dir`` that cannot be a directory.

    Without a budget it is ``DEFAULT_STORE_FREE_SPACE_FRACTION`` of the free space on the file
    system that holds (or will hold) ``root_dir``, measured now."""
    from dualpath.config import KVStoreConfig

    if root_dir is None:
        if capacity_gb is not None:
            raise ValueError(
                "--kv-store-capacity-gb sizes the KV store, and --no-kv-store has none: give one"
            )
        return KVStoreConfig()
    existing = Path(root_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():  # the store would fail on its first block, after the model loaded
        where = "" if existing == Path(root_dir).absolute() else f": {existing}"
        raise ValueError(
            f"KV store {root_dir}{where} is not a directory; pass another --kv-store, or "
            "--no-kv-store"
        )
    if capacity_gb is not None:
        if not 0 < capacity_gb < float("inf"):
            raise ValueError(f"--kv-store-capacity-gb must be > 0 and finite, got {capacity_gb}")
        return KVStoreConfig(root_dir=root_dir, capacity_bytes=gb_to_bytes(capacity_gb))
    free_bytes = shutil.disk_usage(existing).free
    capacity_bytes = int(free_bytes * DEFAULT_STORE_FREE_SPACE_FRACTION)
    if capacity_bytes <= 0:
        raise ValueError(
            f"the file system of the KV store {root_dir} has no free space; free some, pass "
            "--kv-store-capacity-gb, or --no-kv-store"
        )
    logger.info(
        "KV store %s: capacity %.2f GB (%d%% of the %.2f GB free; --kv-store-capacity-gb sets it)",
        root_dir,
        capacity_bytes / 1e9,
        round(DEFAULT_STORE_FREE_SPACE_FRACTION * 100),
        free_bytes / 1e9,
    )
    return KVStoreConfig(root_dir=root_dir, capacity_bytes=capacity_bytes)


def _control_endpoint(text: str) -> str:
    """A scheduler endpoint an engine connects to: tcp://HOST:PORT or ipc://PATH."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    is_tcp = parts.scheme == "tcp" and bool(parts.hostname) and port is not None and port > 0
    if not is_tcp and not (parts.scheme == "ipc" and len(text) > len("ipc://")):
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT or ipc://PATH, got {text!r}")
    return text


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


# --- make-model ------------------------------------------------------------------------------


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from dualpath.model.presets import PRESETS

    p = sub.add_parser(
        "make-model",
        help="write a generated random-weight checkpoint in Hugging Face format",
        description="Write a small random-weight checkpoint (config.json, model.safetensors, "
        "tokenizer.json) with a byte-level BPE tokenizer trained on a bundled text. "
        + " ".join(f"'{name}': {preset.description}." for name, preset in PRESETS.items()),
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, help="which preset (default: tiny)")
    p.add_argument("--out", type=Path, required=True, help="directory to create")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from dualpath.model.make import make_model

    try:
        path = make_model(args.preset, args.out, seed=args.seed, overwrite=args.force)
    except FileExistsError as exc:
        raise ValueError(f"--out {args.out} already exists; pass --force to replace it") from exc
    print(f"wrote preset {args.preset!r} to {path}")
    return 0


# --- convert-gguf ----------------------------------------------------------------------------


def _add_convert_gguf(sub: argparse._SubParsersAction) -> None:
    from dualpath.model.gguf import DEFAULT_DTYPE, DTYPES

    p = sub.add_parser(
        "convert-gguf",
        help="convert a llama.cpp GGUF file into a Hugging Face checkpoint directory",
        description="Dequantize a GGUF file's tensors (the gguf library) and rebuild its "
        "tokenizer, writing config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json (with the chat template) and generation_config.json to --out, "
        "atomically: a failed conversion leaves nothing behind. Supported: llama-architecture "
        "GGUFs with a GPT-2-style BPE vocabulary (e.g. SmolLM2); anything else is refused by "
        "name. This is how the embedded default is made on first use.",
    )
    p.add_argument("gguf", type=Path, help="the .gguf file")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=DEFAULT_DTYPE,
        help=f"stored weight dtype (default {DEFAULT_DTYPE}: the dequantized values exactly, "
        "and the faster of the two on CPUs measured so far)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=_run_convert_gguf)


def _run_convert_gguf(args: argparse.Namespace) -> int:
    from dualpath.model.gguf import convert_gguf

    try:
        path = convert_gguf(args.gguf, args.out, dtype=args.dtype, overwrite=args.force)
    except FileExistsError as exc:
        raise ValueError(f"--out {args.out} already exists; pass --force to replace it") from exc
    print(f"converted {args.gguf} to {path}")
    return 0


# --- generate --------------------------------------------------------------------------------


def _add_engine_args(p: argparse.ArgumentParser, *, default_threads: int | None = None) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face checkpoint directory (default: the embedded SmolLM2-135M-Instruct "
        "under $DUALPATH_HOME/models/, converted from its packaged GGUF on first use)",
    )
    store = p.add_mutually_exclusive_group()
    store.add_argument(
        "--kv-store",
        type=Path,
        default=None,
        help="KV-cache store directory, local or on a POSIX DFS mount (default: $DUALPATH_HOME/kv)",
    )
    store.add_argument(
        "--no-kv-store", action="store_true", help="disable the store: recompute every prompt"
    )
    p.add_argument(
        "--kv-store-capacity-gb",
        type=float,
        default=None,
        help="store budget in GB (1e9 bytes); least-recently-used blocks are evicted beyond it "
        "(default: 25%% of the free space on the store's file system at start)",
    )
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights and KV dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=64,
        help="tokens per KV block, the store's unit (default 64)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=default_threads,
        help="torch CPU threads per engine (default: "
        + (
            "torch's choice, usually one per core)"
            if default_threads is None
            else f"{default_threads})"
        ),
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context limit in tokens (default: the checkpoint's)",
    )
    add_engine_kind_arguments(
        p,
        where="serve and engine; generate: one vLLM engine in this process, its KV from the store",
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion on one engine, reusing KV from the store",
        description="Generate for one prompt on a single engine. The prompt's cached prefix "
        "is loaded from the KV store and every full block is persisted, so a later "
        "invocation whose prompt extends this one reuses its KV.",
    )
    _add_engine_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="prompt as comma-separated token ids")
    p.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate, > 0 (default 16)"
    )
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


def _resolve_model(path: Path | None, *, tiny: bool = False) -> Path:
    """``--model``, else the embedded default: the real SmolLM2-135M-Instruct (converted from
    its packaged GGUF on first use), or with ``tiny`` the random-weight tiny preset (generated
    on first use) that the benchmarks' presets are sized for."""
    if path is not None:
        return path
    if tiny:
        from dualpath.model.make import ensure_model

        return ensure_model(DEFAULT_PRESET, tiny_model_dir())
    from dualpath.model.default import DEFAULT_MODEL_NAME, ensure_default_model

    models_dir = data_home() / "models"
    if not (models_dir / DEFAULT_MODEL_NAME / "config.json").is_file():
        print(
            f"dualpath: converting the embedded default ({DEFAULT_MODEL_NAME}) from its packaged "
            f"GGUF into {models_dir / DEFAULT_MODEL_NAME} (once, about 15 s)",
            file=sys.stderr,
            flush=True,
        )
    return ensure_default_model(models_dir)


def _build_llm(args: argparse.Namespace, model_dir: Path | None = None):  # -> LLM
    kv_store = None if args.no_kv_store else (args.kv_store or default_kv_store_dir())
    store = store_config(kv_store, args.kv_store_capacity_gb)
    from dualpath.engine.llm import LLM  # lazy (torch): keeps --help and refusals fast

    return LLM(
        model_dir or _resolve_model(args.model),
        kv_store=kv_store,
        kv_store_capacity_bytes=store.capacity_bytes,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
    )


def _build_vllm_llm(args: argparse.Namespace):  # -> VllmLLM
    """``generate --engine vllm``: one vLLM engine in this process, with the store behind it."""
    from dualpath.vllm_args import check_vllm_device, check_vllm_installed

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
    model_dir = _resolve_model(args.model)
    from dualpath.vllm.llm import VllmLLM  # lazy: vLLM

    return VllmLLM(
        model_dir,
        kv_store=kv_store,
        kv_store_capacity_bytes=store.capacity_bytes,
        dtype=args.dtype,
        block_size=args.block_size,
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


def _run_generate(args: argparse.Namespace) -> int:
    from dualpath.types import SamplingParams

    engine_kind_args(args)  # --vllm-arg without --engine vllm, or reserved ones: refused
    if args.max_tokens <= 0:
        raise ValueError(f"--max-tokens must be > 0, got {args.max_tokens}")
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


# --- demo ------------------------------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="a short coding-agent conversation on the embedded default, with its KV reuse",
        description="Replay a short coding-agent conversation on the model (default: the "
        "embedded SmolLM2-135M-Instruct) through its chat template: each turn sends the whole "
        "conversation so far plus the next message, as an agent does, and reports the answer and "
        "how much of the prompt's KV came from the store.",
    )
    _add_engine_args(p)
    p.add_argument(
        "--turns",
        type=positive_int,
        default=4,
        help=f"turns to run, <= {len(DEMO_TURNS)} (default 4)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=48,
        help="tokens per answer at most (default 48)",
    )
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
    model_dir = _resolve_model(args.model)
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


# --- engine ----------------------------------------------------------------------------------


def _add_engine(sub: argparse._SubParsersAction) -> None:
    from dualpath.config import MODES

    p = sub.add_parser(
        "engine",
        help="run one prefill or decode engine process that joins a scheduler",
        description="One engine of a PD-disaggregated cluster (one engine = one GPU). It joins "
        "the scheduler at --scheduler with the cluster token from $DUALPATH_CLUSTER_TOKEN. "
        "It stops when the scheduler tells it to or on SIGTERM (exit 0). When the engine dies "
        "or loses the scheduler (no answer, silence, declared dead), this command starts it "
        "again and it rejoins under its id (--no-restart: exit instead). Either --config gives "
        "its whole "
        "configuration (what 'dualpath serve' sends its engines), or the flags below build it "
        "(--role, --scheduler, --engine-id and --node-id required).",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the engine's whole configuration as JSON (an EngineProcessConfig: every field "
        "of its store, engine, cluster and scheduler configs), from this file or '-' for "
        "stdin; no other engine flag may be given with it but --role, --engine-id and "
        "--node-id, which must then agree with it",
    )
    _add_engine_args(p)
    p.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine as a child and start it again when it dies or loses the "
        "scheduler: after 1, 2, 4, ... s (at most 30 s) however often it lost the scheduler, "
        "so a host cut off for a while rejoins once it is back; at most 5 times in 5 minutes "
        "after crashes; never after a refused configuration (default on; --no-restart: run "
        "the engine in this process, exit 3 when the scheduler is lost)",
    )
    p.add_argument("--role", choices=("prefill", "decode"), default=None, help="PE or DE")
    p.add_argument(
        "--scheduler",
        type=_control_endpoint,
        default=None,
        help="the scheduler's control endpoint, tcp://HOST:PORT",
    )
    p.add_argument(
        "--engine-id", type=non_negative_int, default=None, help="this engine's id in the topology"
    )
    p.add_argument("--node-id", type=non_negative_int, default=None, help="the node it belongs to")
    p.add_argument(
        "--mode", choices=MODES, default="dualpath", help="comparison mode (default dualpath)"
    )
    p.add_argument(
        "--transport", choices=TRANSPORT_KINDS, default="nixl", help="PE<->DE KV transport"
    )
    p.add_argument(
        "--snic-gbps", type=non_negative_float, default=0.0, help="node SNIC cap, Gbps (0 = none)"
    )
    p.add_argument(
        "--cnic-gbps", type=non_negative_float, default=0.0, help="engine CNIC cap, Gbps (0 = none)"
    )
    p.add_argument(
        "--buffer-gb",
        type=positive_float,
        default=None,
        help="host KV buffer, GB (default: sized at start to hold two requests of the model's "
        "whole context; a size that cannot hold one is refused, naming the size needed)",
    )
    p.add_argument("--kv-cache-gb", type=positive_float, default=1.0, help="device KV cache, GB")
    p.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=8192, help="tokens per step"
    )
    p.add_argument(
        "--heartbeat-timeout-s",
        type=positive_float,
        default=5.0,
        help="exit when the scheduler is silent this long (default 5)",
    )
    p.add_argument(
        "--attention-quota-s",
        type=positive_float,
        default=0.3,
        help="PE: predicted seconds of one layer per prefill batch, the compute quota "
        "(default 0.3); longer prompts are prefilled in chunks across batches",
    )
    # Every flag but --config and --restart at its default: what --config may be given with.
    defaults = vars(p.parse_args([]))
    del defaults["config"], defaults["restart"]
    p.set_defaults(func=_run_engine, engine_flag_defaults=defaults)


def _run_engine(args: argparse.Namespace) -> int:
    from dualpath.cluster.engine_processes import TOKEN_ENV, run_supervised

    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"set ${TOKEN_ENV} to the cluster token the scheduler was started with")
    config = engine_process_config(args)
    _check_engine_capacity(config)
    if config.engine.device != "cpu":
        from dualpath.model.loader import available_device  # lazy: torch

        available_device(config.engine.device)  # before a child is started, or restarted
    if args.restart:
        return run_supervised(config, token)
    from dualpath.cluster.engine_process import run_engine

    return run_engine(config, token)


def _check_engine_capacity(config) -> None:  # config: EngineProcessConfig
    """Refuse, before the engine starts, a buffer or KV cache too small for one request of the
    model's context (exit 2: a refused configuration is never restarted)."""
    from dualpath.engine.capacity import check_capacity
    from dualpath.model.identity import kv_layout
    from dualpath.model.registry import read_config
    from dualpath.vllm_args import check_engine_kind, check_vllm_installed

    model_config = read_config(Path(config.model_dir) / "config.json")
    engine = config.engine
    if engine.engine == "vllm":
        check_vllm_installed()
    check_capacity(
        config.cluster,
        engine,
        kv_layout(model_config, engine.dtype, engine.block_size_tokens),
        engine.max_model_len or model_config.max_position_embeddings,
    )
    check_engine_kind(config.cluster, engine)


# Flags that may come with --config, where they must agree with it: they name the engine in a
# process list (`dualpath serve` passes them for that).
_ENGINE_IDENTITY = ("role", "engine_id", "node_id")


def engine_process_config(args: argparse.Namespace):
    """``dualpath engine``'s configuration: ``--config``'s JSON, or built from the flags."""
    given = [
        dest
        for dest, default in args.engine_flag_defaults.items()
        if getattr(args, dest) != default
    ]
    if args.config is not None:
        others = [dest for dest in given if dest not in _ENGINE_IDENTITY]
        if others:
            flags = ", ".join("--" + dest.replace("_", "-") for dest in others)
            raise ValueError(f"--config gives the whole configuration; leave out {flags}")
        config = _read_engine_config(args.config)
        for dest in _ENGINE_IDENTITY:  # given with --config: they name the same engine
            flag, configured = getattr(args, dest), getattr(config, dest)
            if flag is not None and flag != configured:
                raise ValueError(
                    f"--{dest.replace('_', '-')} {flag} differs from the --config's {configured}"
                )
        return config
    missing = [
        "--" + dest.replace("_", "-")
        for dest in ("role", "scheduler", "engine_id", "node_id")
        if getattr(args, dest) is None
    ]
    if missing:
        raise ValueError(f"give --config, or {', '.join(missing)}")
    return _engine_config_from_flags(args)


def _read_engine_config(source: str):  # -> EngineProcessConfig
    """``--config``'s JSON, from a file or '-' for stdin; ``ValueError`` naming the source and
    what is wrong (unreadable, not JSON, a required field missing, a bad field)."""
    import dataclasses

    from dualpath.config import EngineProcessConfig, config_from_dict

    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise ValueError(f"--config {source}: cannot be read: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {source}: not JSON: {exc}") from exc
    missing = [
        field.name
        for field in dataclasses.fields(EngineProcessConfig)
        if isinstance(data, dict)
        and field.default is dataclasses.MISSING
        and field.name not in data
    ]
    if missing:
        raise ValueError(
            f"--config {source}: missing {', '.join(missing)} (an EngineProcessConfig, as "
            "'dualpath serve' sends its engines)"
        )
    try:
        return config_from_dict(EngineProcessConfig, data)
    except ValueError as exc:
        raise ValueError(f"--config {source}: {exc}") from exc


def _engine_config_from_flags(args: argparse.Namespace):
    from dualpath.config import (
        ClusterConfig,
        EngineConfig,
        EngineProcessConfig,
        SchedulerConfig,
        TrafficConfig,
    )

    buffer_bytes = None if args.buffer_gb is None else gb_to_bytes(args.buffer_gb)
    return EngineProcessConfig(
        role=args.role,
        engine_id=args.engine_id,
        node_id=args.node_id,
        scheduler_endpoint=args.scheduler,
        model_dir=_resolve_model(args.model),
        store=store_config(
            None if args.no_kv_store else (args.kv_store or default_kv_store_dir()),
            args.kv_store_capacity_gb,
        ),
        engine=EngineConfig(
            block_size_tokens=args.block_size,
            device=args.device,
            dtype=args.dtype or "float32",
            kv_cache_bytes=gb_to_bytes(args.kv_cache_gb),
            max_model_len=args.max_model_len,
            num_threads=args.threads,
            max_num_batched_tokens=args.max_num_batched_tokens,
            **engine_kind_args(args),
        ),
        cluster=ClusterConfig(
            mode=args.mode,
            traffic=TrafficConfig(
                snic_bandwidth_gbps=args.snic_gbps, cnic_bandwidth_gbps=args.cnic_gbps
            ),
            prefill_buffer_bytes=buffer_bytes,
            decode_buffer_bytes=buffer_bytes,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
        ),
        scheduler=SchedulerConfig(
            block_size_tokens=args.block_size,
            attention_quota_s=args.attention_quota_s,
            min_prefill_chunk_tokens=args.block_size,
        ),
        transport=args.transport,
    )


# --- serve -----------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from dualpath.server.args import add_serve_arguments, detach_defaults

    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API from a one-host PD-disaggregated cluster",
        description="Start the scheduler and the HTTP API in this process and every engine as "
        "its own process, then serve /v1/completions, /v1/chat/completions, /v1/models, "
        "/tokenize, /detokenize, /health, /metrics and /version until SIGINT or SIGTERM. "
        "Without flags: the embedded SmolLM2-135M-Instruct (converted on first use), the store under "
        "$DUALPATH_HOME/kv, 1 prefill and 2 decode engines, no link caps, 127.0.0.1:8000.",
    )
    _add_engine_args(p, default_threads=1)  # engines share the host: one thread each
    add_serve_arguments(p)
    p.set_defaults(func=_run_serve, serve_options=detach_defaults(p))


def _run_serve(args: argparse.Namespace) -> int:
    from dualpath.cluster.engine_processes import TOKEN_ENV
    from dualpath.cluster.launcher import LocalCluster
    from dualpath.config import DTYPES
    from dualpath.model.registry import read_config
    from dualpath.model.tokenizer import Tokenizer
    from dualpath.server.args import resolve
    from dualpath.server.chat import ChatRenderer

    s = resolve(args, args.serve_options)
    token = os.environ.get(TOKEN_ENV) or None
    if s.external_engines and token is None:
        raise ValueError(f"--external-engines needs ${TOKEN_ENV}, shared with the engines")
    if s.engine == "vllm" and not s.external_engines:  # the engines it starts run this Python
        from dualpath.vllm_args import check_vllm_installed

        check_vllm_installed()
    model_dir = _resolve_model(s.model)
    dtype = s.dtype or read_config(model_dir / "config.json").torch_dtype
    if dtype not in DTYPES:
        raise ValueError(f"the checkpoint's dtype {dtype!r} is not supported; pass --dtype")
    if s.device != "cpu" and not s.external_engines:
        from dualpath.model.loader import available_device  # lazy: torch

        available_device(s.device)  # here, not in each engine it would start
    tokenizer = Tokenizer(model_dir / "tokenizer.json")
    chat = ChatRenderer.for_checkpoint(model_dir)
    server_config = _serve_server_config(s, model_dir)
    cluster = LocalCluster(
        _serve_cluster_config(s),
        model_dir=model_dir,
        store=store_config(
            None if s.no_kv_store else (s.kv_store or default_kv_store_dir()),
            s.kv_store_capacity_gb,
        ),
        engine=_serve_engine_config(s, dtype),
        transport=s.transport,
        prefill_tokens_per_s=s.prefill_tokens_per_s,
        attention_quota_s=s.attention_quota_s,
        log_dir=s.engine_log_dir or _server_log_dir(),
        spawn_engines=not s.external_engines,
        token=token,
        restart_engines=s.restart_engines,
    )
    from dualpath.server.context import ServingContext  # lazy, as the rest: after the checks
    from dualpath.server.serve import run_server

    context = ServingContext(server_config, cluster, tokenizer, chat)
    url = f"http://{server_config.host}:{server_config.port}"
    print(
        f"dualpath serve: model {server_config.served_model_name!r} on {url}; engines joining "
        f"the scheduler at {cluster.coordinator.endpoint} (GET /health turns 200 when ready); "
        f"{_store_summary(cluster.store_config)}; engine logs in {cluster.log_dir}",
        file=sys.stderr,
        flush=True,
    )
    return run_server(
        context,
        on_ready=lambda: print(f"dualpath serve: ready on {url}", file=sys.stderr, flush=True),
    )


def _store_summary(store) -> str:  # store: KVStoreConfig
    if store.root_dir is None:
        return "no KV store"
    return f"KV store {store.root_dir} of at most {store.capacity_bytes / 1e9:.2f} GB"


def _server_log_dir() -> Path:
    """This server's own folder for its engines' logs: servers running side by side (or one
    after another) never write into each other's files."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return data_home() / "logs" / f"serve-{stamp}-{os.getpid()}"


def _serve_server_config(s: argparse.Namespace, model_dir: Path):  # -> ServerConfig
    from dualpath.server.config import ServerConfig

    return ServerConfig(
        served_model_name=s.served_model_name or model_dir.name,
        host=s.host,
        port=s.port,
        api_key=s.api_key or os.environ.get("DUALPATH_API_KEY") or None,
        max_waiting_requests=s.max_waiting_requests,
        max_request_bytes=s.max_request_bytes,
        max_prompt_tokens=s.max_prompt_tokens,
        engine_start_timeout_s=s.engine_start_timeout_s,
        shutdown_timeout_s=s.shutdown_timeout_s,
        generation_config=s.generation_config,
    )


def _serve_cluster_config(s: argparse.Namespace):  # -> ClusterConfig
    from dualpath.config import ClusterConfig, TrafficConfig, parse_node_shape

    num_prefill_nodes, num_decode_nodes = parse_node_shape(s.nodes)
    buffer_bytes = None if s.buffer_gb is None else gb_to_bytes(s.buffer_gb)
    return ClusterConfig(
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
        engines_per_node=s.engines_per_node,
        nodes_per_group=s.nodes_per_group,
        mode=s.mode,
        read_path=s.read_path,
        traffic=TrafficConfig(
            snic_bandwidth_gbps=s.snic_gbps,
            cnic_bandwidth_gbps=s.cnic_gbps,
            host_memory_bandwidth_gbps=s.host_memory_gbps,
        ),
        prefill_buffer_bytes=buffer_bytes,
        decode_buffer_bytes=buffer_bytes,
        control_endpoint=s.scheduler_endpoint,
        heartbeat_timeout_s=s.heartbeat_timeout_s,
        persist_wait_s=s.persist_wait_s,
    )


def _serve_engine_config(s: argparse.Namespace, dtype: str):  # -> EngineConfig
    from dualpath.config import EngineConfig

    return EngineConfig(
        block_size_tokens=s.block_size,
        device=s.device,
        dtype=dtype,
        kv_cache_bytes=gb_to_bytes(s.kv_cache_gb),
        max_model_len=s.max_model_len,
        num_threads=s.threads,
        max_num_batched_tokens=s.max_num_batched_tokens,
        **engine_kind_args(s),
    )


# --- simulate, plan --------------------------------------------------------------------------


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from dualpath.config import MODES, READ_PATHS

    p = sub.add_parser(
        "simulate",
        help="cluster simulator: SPEC §7 experiments or a free-form run (no GPU needed)",
        description="Discrete-event simulation of a DualPath cluster driven by the real "
        "scheduler. Prints a table beside the paper's figure; --json/--png write results.",
    )
    p.add_argument(
        "--experiment",
        default=None,
        help="offline-jct, ablation, snic-balance, pd-ratio, online-capacity, scale, "
        "append-scaling; all: every one of those in one run (runs they share are simulated "
        "once; one JSON, one PNG); or fidelity: profile this machine (local profile), run a real "
        "'dualpath bench offline --preset ci --seed 1' for basic and dualpath, simulate the "
        "same and report the JCT errors",
    )
    p.add_argument(
        "--bench-json",
        type=Path,
        default=None,
        help="fidelity: compare with this earlier 'dualpath bench offline' JSON instead of "
        "running the benchmark",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="fidelity: measure the local profile again, just before the benchmark (the "
        "machine's speed drifts), instead of reading the packaged dualpath/sim/local_profile.json",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="fidelity: the local profile to read, or with --reprofile to write (default: the "
        "packaged one; with --reprofile, a file in a temporary directory)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="re-run the fit of the one fitted factor (prefill efficiency) to Table 3's 2P4D "
        "JCT and print it (dualpath/sim/calibration.py); a few full-size runs",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the paper's whole grid (e.g. scale: 48P96D offline and 44P88D online instead of "
        "8P16D; offline-jct: 32K-64K, 512-2,048 agents and the 27B)",
    )
    p.add_argument(
        "--scale-down",
        type=positive_int,
        default=1,
        help="K: nodes with 8/K GPUs (node links /K) and K times fewer agents",
    )
    _add_profiles(p, default_model="deepseek-v3.2-660b", what="free-form runs")
    p.add_argument("--nodes", default="2P4D", help="cluster shape, e.g. 2P4D (default)")
    p.add_argument("--agents", type=positive_int, default=1024, help="agents (trajectories)")
    p.add_argument(
        "--max-len",
        type=positive_int,
        default=65536,
        help="32768, 49152 or 65536 (SPEC §7 presets)",
    )
    p.add_argument(
        "--modes", default="basic,dualpath,oracle", help=f"comma-separated, from {', '.join(MODES)}"
    )
    p.add_argument("--trace", type=Path, default=None, help="a Mooncake-format JSONL trace")
    p.add_argument(
        "--length-scale",
        type=positive_float,
        default=None,
        help="free-form runs on --trace: scale every prompt's lengths by this (default 1: the "
        "trace's own), as 'dualpath bench' does",
    )
    p.add_argument(
        "--max-turns",
        type=positive_int,
        default=None,
        help="free-form runs on --trace: keep each session's first N turns (default: all), as "
        "'dualpath bench' does",
    )
    p.add_argument(
        "--gen-scale",
        type=positive_float,
        default=None,
        help="free-form runs on --trace: every turn generates max(1, round(g x this)) tokens "
        "instead of g (default 1), as 'dualpath bench' does",
    )
    p.add_argument(
        "--online",
        action="store_true",
        help="free-form runs: also each mode's capacity (agents per second) under SPEC §7's "
        "SLO (TTFT <= 4 s, TPOT <= 50 ms), searched as the online-capacity experiment does; "
        "a trace's sessions arrive as a Poisson process, round robin as copies",
    )
    p.add_argument(
        "--read-path",
        choices=READ_PATHS,
        default=None,
        help="free-form runs: force every mode's read side (split: each request's blocks on "
        "both sides; default: each mode's own)",
    )
    p.add_argument(
        "--frontend-rps",
        type=positive_float,
        default=None,
        help="free-form runs: turns per second the front end admits, one after another, for "
        "the whole cluster (default: the hardware profile's, 10000 on hopper-8x400); matters "
        "when many agents start together",
    )
    p.add_argument(
        "--attention-quota-s",
        type=positive_float,
        default=None,
        help="free-form runs: the PE compute quota, predicted seconds of one attention layer "
        "per prefill batch (default SPEC §6's 0.3); 0.3 / 61 reads the quota as a whole "
        "DeepSeek-V3.2 forward instead (docs/simulator-analysis.md, 'ping-pong')",
    )
    p.add_argument(
        "--quota-per-forward",
        action="store_true",
        help="read SPEC §6's 300 ms compute quota as the attention time of a whole forward "
        "(300 ms / layers per layer), with that reading's own fitted prefill efficiency: an "
        "alternative to the default per-layer reading, for experiments, free-form runs and "
        "--calibrate (docs/simulator-analysis.md, 'ping-pong')",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="workload seed (default 0) of a free-form run or of every run of --experiment "
        "(except fidelity): the paper checks were made on 0, and the fitted one was fitted on it",
    )
    p.add_argument("--json", type=Path, default=None, help="write runs and checks here")
    p.add_argument("--png", type=Path, default=None, help="write the figure here")
    _add_jobs(p, "experiments and free-form runs")
    _add_no_progress(p)
    p.set_defaults(
        func=_run_simulate,
        free_form_defaults={dest: p.get_default(dest) for dest in _FREE_FORM_ONLY},
    )


# ``simulate`` flags that shape a free-form run; an experiment or --calibrate refuses them
# rather than ignore them (they run the paper's configurations).
_FREE_FORM_ONLY = (
    "model",
    "hardware",
    "nodes",
    "agents",
    "max_len",
    "modes",
    "trace",
    "length_scale",
    "max_turns",
    "gen_scale",
    "online",
    "read_path",
    "frontend_rps",
    "attention_quota_s",
    "seed",
)


def _add_profiles(p: argparse.ArgumentParser, *, default_model: str, what: str) -> None:
    from dualpath.sim.profiles import HARDWARE, MODELS

    file_help = (
        'or a JSON file of the profile\'s fields, or of "base" (a built-in name) and the '
        "fields that differ (dualpath/sim/profiles.py)"
    )
    p.add_argument(
        "--model",
        default=default_model,
        help=f"{what}: model profile, {', '.join(MODELS)} (default {default_model}), {file_help}",
    )
    p.add_argument(
        "--hardware",
        default="hopper-8x400",
        help=f"{what}: node and fabric profile, {', '.join(HARDWARE)} (default hopper-8x400; "
        f"'local' only for plan's SPEC §5 bounds), {file_help}",
    )


def _add_jobs(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help=f"{what}: simulate independent runs N at a time in worker processes, one core "
        "each (default 1; the results are the same either way, wall times aside; with N > 1 "
        "one progress bar counts the runs)",
    )


def _add_no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar per simulated run and no line per finished run on stderr",
    )


def _print_run(record: dict) -> None:
    """One finished run, on stderr above the progress bars (the table goes to stdout)."""
    from tqdm import tqdm

    jct = "" if record["jct_s"] is None else f" JCT {record['jct_s']:,.1f} s"
    aps = f" at {record['aps']:.4g} APS" if "aps" in record else ""
    tqdm.write(
        f"done: {record['model']} {record['nodes']} {record['mode']} {record['agents']} "
        f"agents{aps}:{jct} ({record['wall_s']:.1f} s)",
        file=sys.stderr,
    )


def _run_simulate(args: argparse.Namespace) -> int:
    import time

    from dualpath.sim import experiments, report
    from dualpath.sim.agents import workload_agents
    from dualpath.sim.profiles import resolve_hardware, resolve_model
    from dualpath.sim.runner import BLOCK_SIZE_TOKENS

    start_s = time.perf_counter()
    _check_simulate_runs(args)
    if args.calibrate or args.experiment is not None:
        takes_seed = not args.calibrate and args.experiment != "fidelity"
        for dest, default in args.free_form_defaults.items():
            if dest == "seed" and takes_seed:
                continue  # the SPEC §7 experiments run on any workload seed
            if getattr(args, dest) != default:
                what = "--calibrate" if args.calibrate else f"--experiment {args.experiment}"
                raise ValueError(
                    f"--{dest.replace('_', '-')} shapes free-form runs; {what} runs its own "
                    "configurations (leave --experiment out for a free-form run)"
                )
    if args.calibrate:
        from dualpath.sim.calibration import CALIBRATION_TARGET_JCT_S, fit_prefill_efficiency

        answer, tried = fit_prefill_efficiency(
            quota_per_forward=args.quota_per_forward, progress=not args.no_progress
        )
        for efficiency, jct_s in tried:
            print(f"prefill_efficiency {efficiency:.4f}: JCT {jct_s:.1f} s")
        print(
            f"fitted prefill_efficiency {answer:.4f} (where a least-squares line through the "
            f"runs in 1 / efficiency meets Table 3's 2P4D {CALIBRATION_TARGET_JCT_S:.0f} s)"
        )
        return 0
    if args.experiment == "fidelity":
        return _run_fidelity(args)
    if args.experiment is not None:
        names = list(experiments.EXPERIMENTS) if args.experiment == "all" else [args.experiment]
        results = experiments.run_experiments(
            names,
            scale_down=args.scale_down,
            full=args.full,
            quota_per_forward=args.quota_per_forward,
            seed=args.seed,
            on_run=None if args.no_progress else _print_run,
            progress=not args.no_progress,
            jobs=args.jobs,
        )
    else:
        preset = _preset(args.max_len)
        agents = None
        if args.trace is not None:
            from dualpath.workload import load_mooncake_trace
            from dualpath.workload.shape import cap_turns, scale_generations

            workload = load_mooncake_trace(
                args.trace,
                vocab_size=32_000,
                seed=args.seed,
                max_sessions=args.agents,
                length_scale=args.length_scale or 1.0,
            )
            workload = scale_generations(cap_turns(workload, args.max_turns), args.gen_scale or 1.0)
            agents = workload_agents(workload, block_size_tokens=BLOCK_SIZE_TOKENS)
        elif (args.length_scale, args.max_turns, args.gen_scale) != (None, None, None):
            raise ValueError(
                "--length-scale, --max-turns and --gen-scale shape a --trace; give one, or "
                "leave them out"
            )
        result = experiments.free_form(
            model=resolve_model(args.model),
            hardware=resolve_hardware(args.hardware),
            nodes=args.nodes,
            num_agents=args.agents,
            preset=preset,
            modes=args.modes.split(","),
            scale_down=args.scale_down,
            seed=args.seed,
            agents=agents,
            read_path=args.read_path,
            frontend_requests_per_s=args.frontend_rps,
            attention_quota_s=args.attention_quota_s,
            quota_per_forward=args.quota_per_forward,
            online=args.online,
            on_run=None if args.no_progress else _print_run,
            progress=not args.no_progress,
            jobs=args.jobs,
        )
        results = [result]
    data = report.result_json(results, time.perf_counter() - start_s)
    print("\n\n".join(report.format_table(result) for result in results))
    if len(results) > 1:
        # A check two experiments make on one shared run (the calibration target) counts once.
        verdicts = {check["name"]: check["ok"] for check in data["checks"]}
        missed = [name for name, ok in verdicts.items() if not ok]
        print(f"\n{len(verdicts) - len(missed)} of {len(verdicts)} checks ok", end="")
        print(f"; missed: {', '.join(missed)}" if missed else "")
    build = "compiled build" if data["compiled"] else "Python sources"
    print(f"wall {data['wall_s']:.1f} s, {data['events_per_s']} events/s ({build})")
    if args.json is not None:
        report.write_json(data, args.json)
    if args.png is not None:
        report.write_png(results, args.png)
    return 0


def _check_simulate_runs(args: argparse.Namespace) -> None:
    """``ValueError`` for flags that belong to a kind of run other than the one asked for
    (each would be ignored)."""
    if args.calibrate and args.experiment is not None:
        raise ValueError("--calibrate runs the fit alone: leave out --experiment")
    fidelity_flags = [
        flag
        for flag, is_given in (
            ("--bench-json", args.bench_json is not None),
            ("--profile", args.profile is not None),
            ("--reprofile", args.reprofile),
        )
        if is_given
    ]
    if fidelity_flags and args.experiment != "fidelity":
        raise ValueError(f"{', '.join(fidelity_flags)}: only for --experiment fidelity")
    if args.full and args.experiment in (None, "fidelity"):
        raise ValueError("--full runs an experiment's whole grid: give --experiment NAME or all")


def _run_fidelity(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from dualpath.sim.fidelity import FIDELITY_TOLERANCE, run_fidelity

    with tempfile.TemporaryDirectory(prefix="dualpath-fidelity-") as tmp:
        rows = run_fidelity(
            work_dir=Path(tmp),
            bench_json=args.bench_json,
            profile_path=args.profile,
            reprofile=args.reprofile,
        )
    print("== fidelity (local profile vs dualpath bench offline --preset ci --seed 1) ==")
    print("mode | measured JCT s | simulated JCT s | error | TTFT p50 ms | TPOT p50 ms")
    for row in rows:
        verdict = "ok" if abs(row["error"]) <= FIDELITY_TOLERANCE else "MISS"
        print(
            f"{row['mode']} | {row['measured_s']:.2f} | {row['simulated_s']:.2f} | "
            f"{100 * row['error']:+.1f}% ({verdict}, +-{100 * FIDELITY_TOLERANCE:.0f}%) | "
            f"{_ms(row['measured_ttft_p50_s'])} vs {_ms(row['simulated_ttft_p50_s'])} | "
            f"{_ms(row['measured_tpot_p50_s'])} vs {_ms(row['simulated_tpot_p50_s'])}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"fidelity": rows}, indent=1) + "\n")
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="P/D advisor: SPEC §5 bounds for the hardware, then the simulator's best P/D",
        description="Evaluates SPEC §5's bottleneck-free P/D range and simulates candidate "
        "P/D shapes to recommend the best throughput per GPU for a workload.",
    )
    _add_profiles(p, default_model="27b", what="the candidate shapes")
    p.add_argument(
        "--total-nodes", type=positive_int, default=3, help="nodes to split into P and D"
    )
    p.add_argument("--agents", type=positive_int, default=256, help="agents (trajectories)")
    p.add_argument(
        "--max-len", type=positive_int, default=65536, help="32768, 49152 or 65536 (SPEC §7)"
    )
    p.add_argument("--mode", default="dualpath", help="mode to plan for (default dualpath)")
    p.add_argument(
        "--scale-down", type=positive_int, default=1, help="simulate a K-times smaller cluster"
    )
    p.add_argument(
        "--quota-per-forward",
        action="store_true",
        help="simulate with SPEC §6's compute quota read as a whole forward, as `dualpath "
        "simulate --quota-per-forward` (default: per attention layer)",
    )
    _add_jobs(p, "the candidate shapes")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the advice here: what was planned for, pd_range, candidates (nodes, "
        "jct_s, turns_per_s_per_gpu, pd_ratio, inside_pd_range) and recommended",
    )
    _add_no_progress(p)
    p.set_defaults(func=_run_plan)


def _preset(max_len: int) -> str:
    """The SPEC §7 workload preset of ``--max-len`` (a CLI error names the choices)."""
    from dualpath.sim.runner import PRESET_BY_MAX_LEN

    if max_len not in PRESET_BY_MAX_LEN:
        raise ValueError(f"--max-len must be one of {sorted(PRESET_BY_MAX_LEN)}, got {max_len}")
    return PRESET_BY_MAX_LEN[max_len]


def _run_plan(args: argparse.Namespace) -> int:
    from dualpath.sim import report
    from dualpath.sim.plan import recommend_pd
    from dualpath.sim.profiles import resolve_hardware, resolve_model

    preset = _preset(args.max_len)
    model, hardware = resolve_model(args.model), resolve_hardware(args.hardware)
    advice = recommend_pd(
        model=model,
        hardware=hardware,
        total_nodes=args.total_nodes,
        num_agents=args.agents,
        preset=preset,
        mode=args.mode,
        scale_down=args.scale_down,
        quota_per_forward=args.quota_per_forward,
        progress=not args.no_progress,
        jobs=args.jobs,
    )
    print("\n".join(advice.lines))
    if args.json is not None:
        data = advice.as_dict(
            model=model.name,
            hardware=hardware.name,
            total_nodes=args.total_nodes,
            agents=args.agents // args.scale_down,
            max_len=args.max_len,
            mode=args.mode,
            scale_down=args.scale_down,
            quota_per_forward=args.quota_per_forward,
        )
        report.write_json(data, args.json)
    return 0


# --- bench -----------------------------------------------------------------------------------


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (each writes a JSON result with --json)")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, module_name, help_text in (
        ("store", "dualpath.bench.store_bench", "KV store read GB/s vs plain reads, cold and warm"),
        (
            "scheduler",
            "dualpath.bench.scheduler_bench",
            "pure-policy placements per second at cluster scale",
        ),
        (
            "transfer",
            "dualpath.bench.transfer_bench",
            "cross-process KV transfer GB/s (NIXL or shared memory) vs an in-process copy",
        ),
        (
            "engine",
            "dualpath.bench.engine_bench",
            "prefill and decode tokens/s of our engine vs transformers' generate on the same "
            "weights, float32 vs bfloat16, against the memory-bandwidth bound",
        ),
        (
            "offline",
            "dualpath.bench.offline",
            "N agents on a one-host PD cluster per mode: JCT and bytes per read path",
        ),
        (
            "online",
            "dualpath.bench.online",
            "Poisson agent arrivals per mode: SLO attainment and, with --find-capacity, the "
            "largest APS that holds the SLO",
        ),
        (
            "vs-vllm",
            "dualpath.bench.vllm_compare",
            "one agentic replay against dualpath on vLLM engines (1P1D, 1P2D), vLLM's own P/D "
            "of the same shapes (NixlConnector behind a proxy) and one vLLM instance: JCT, "
            "TTFT, TPOT side by side (run from .venv-vllm)",
        ),
    ):
        module = __import__(module_name, fromlist=["main"])
        bp = bench_sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(bp)
        bp.set_defaults(func=module.main)


# --- main ------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands'), whose usage errors read as every other
    error of the command does: one ``dualpath: error:`` line, exit 2, and where to look."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("dualpath").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"dualpath: error: {where}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dualpath",
        description="DualPath LLM serving for agentic, multi-turn workloads.",
    )
    parser.add_argument("--version", action="version", version=f"dualpath {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="logging level (default WARNING)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    adders: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
        _add_make_model,
        _add_convert_gguf,
        _add_generate,
        _add_demo,
        _add_engine,
        _add_serve,
        _add_bench,
        _add_simulate,
        _add_plan,
    )
    for add in adders:
        add(sub)
    return parser


# Flags naming what a command writes (most of them when it is done): a file, or a folder.
_OUTPUT_FILE_DESTS = ("json", "png")
_OUTPUT_DIR_DESTS = ("out_dir", "engine_log_dir")


def _prepare_outputs(args: argparse.Namespace) -> None:
    """Make the folders the output files go in, or refuse an output path that cannot be
    written (``ValueError`` naming the flag), before the command starts: a typo in ``--json``
    must not cost a benchmark's run."""
    for dest in _OUTPUT_FILE_DESTS + _OUTPUT_DIR_DESTS:
        path = getattr(args, dest, None)
        if not isinstance(path, Path):  # not given, or not a path (generate's --json)
            continue
        flag = "--" + dest.replace("_", "-")
        is_file = dest in _OUTPUT_FILE_DESTS
        if is_file and path.is_dir():
            raise ValueError(f"{flag} {path} is a directory; name a file")
        if not is_file and path.exists() and not path.is_dir():
            raise ValueError(f"{flag} {path} is a file; name a directory")
        existing = path.parent.absolute()
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"{flag} {path}: {existing} is not a directory")
        if not os.access(existing, os.W_OK):
            raise ValueError(f"{flag} {path}: {existing} is not writable")
        if is_file:
            path.parent.mkdir(parents=True, exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _prepare_outputs(args)
        return int(args.func(args) or 0)
    except (ValueError, DualPathError) as exc:
        parser.exit(2, f"dualpath: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
