"""The ``dualpath`` command's parser class, and its lazily filled benchmark subcommands."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands'), whose usage errors read as every other
    error of the command does: one ``dualpath: error:`` line, exit 2, and where to look."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("dualpath").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"dualpath: error: {where}{message} (see {self.prog} --help)\n")


class ModuleParser(Parser):
    """A subcommand whose options (``add_arguments``) and entry point (``main``) are those of
    ``module_name``, imported on first use: when the subcommand is parsed or its help shown.
    The benchmark modules import the HTTP client, the cluster and numpy, which every other
    command (an engine process among them) would otherwise load at start for nothing."""

    def __init__(self, *args: Any, module_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module_name = module_name
        self._is_filled = False

    def _fill(self) -> None:
        if not self._is_filled:
            self._is_filled = True
            module = importlib.import_module(self._module_name)
            module.add_arguments(self)
            self.set_defaults(func=module.main)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._fill()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._fill()
        return super().format_usage()

    def format_help(self) -> str:
        self._fill()
        return super().format_help()
