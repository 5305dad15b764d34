"""The ``dualpath`` command: the only place that reads argv and the environment.

    dualpath make-model --preset tiny --out DIR
    dualpath generate --prompt "Hello" --max-tokens 16 [--json]
    dualpath demo
    dualpath serve [--model DIR] [--port 8000]    # OpenAI-compatible API on a one-host cluster
    dualpath bench store | scheduler ...

Set ``DUALPATH_HOME`` to move the default data directory (models and KV store), which is
``~/.cache/dualpath`` otherwise.

One module per command (``model`` holds make-model and convert-gguf, ``generate`` holds
generate and demo); the options several commands share are defined once, in ``options``;
flags become configs in ``configs``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

from dualpath import __version__
from dualpath.cli.bench import add_bench
from dualpath.cli.configs import (
    DEFAULT_STORE_FREE_SPACE_FRACTION,
    engine_process_config,
    store_config,
)
from dualpath.cli.engine import add_engine
from dualpath.cli.generate import add_demo, add_generate
from dualpath.cli.model import add_convert_gguf, add_make_model
from dualpath.cli.parser import Parser
from dualpath.cli.plan import add_plan
from dualpath.cli.serve import add_serve
from dualpath.cli.simulate import add_simulate
from dualpath.cli.vllm_config import add_vllm_config
from dualpath.errors import DualPathError

__all__ = [
    "DEFAULT_STORE_FREE_SPACE_FRACTION",
    "build_parser",
    "engine_process_config",
    "main",
    "store_config",
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
        add_make_model,
        add_convert_gguf,
        add_generate,
        add_demo,
        add_engine,
        add_serve,
        add_vllm_config,
        add_bench,
        add_simulate,
        add_plan,
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
