"""The ``dualpath serve`` flags, and ``--config FILE``: the same settings from YAML or JSON;
where serve's flags and its config file meet (``configs.py`` is where they become configs).

Precedence: a flag on the command line, then the config file, then the flag's default. Keys
are flag names with dashes or underscores (``kv-store`` or ``kv_store``); an unknown key, or
a value the flag would refuse, is an error that names the file and the key. Paths in the file
are taken as given (relative to the working directory, as on the command line).

How: the ``serve`` parser's defaults are detached (``detach_defaults``), so that parsing
leaves only what the command line gave in the namespace; ``resolve`` layers the rest under it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.cluster_options import (
    add_attention_quota_argument,
    add_engine_memory_arguments,
    add_engines_per_node_argument,
    add_heartbeat_argument,
    add_link_cap_arguments,
    add_listen_arguments,
    add_max_prompt_tokens_argument,
    add_mode_argument,
    add_nodes_argument,
    add_nodes_per_group_argument,
    add_read_path_argument,
    add_transport_argument,
)
from dualpath.flags import non_negative_float, non_negative_int, positive_float, positive_int
from dualpath.options import add_decode_threads_argument
from dualpath.server.config import GENERATION_CONFIG_MODES

# Flags that exclude each other: the command line giving one drops the file's other.
_EXCLUSIVE_DESTS = (("kv_store", "no_kv_store"),)
_NOT_IN_FILE = ("config", "help")
# The file's section of vLLM engine arguments (a mapping, KEY: VALUE), or ``vllm-arg`` as a
# list of KEY=VALUE strings; the command line's --vllm-arg win key by key.
_VLLM_ARGS_KEYS = ("vllm_args", "vllm_arg")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``serve`` flag except the engine ones ``dualpath.options.add_engine_arguments`` adds."""
    p.add_argument(
        "--config",
        type=Path,
        help="YAML or JSON file of settings: keys are these flags' names (dashes or "
        "underscores); flags on the command line win",
    )
    http = p.add_argument_group("HTTP API")
    add_listen_arguments(http)
    http.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients name in requests (default: the model directory's name)",
    )
    http.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
        "(default: $DUALPATH_API_KEY if set, else no key)",
    )
    http.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=512,
        help="generations admitted without a first token yet; beyond this, 429 (default 512)",
    )
    http.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=8 << 20,
        help="largest request body; larger ones get 413 (default 8388608)",
    )
    add_max_prompt_tokens_argument(http)
    http.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default="auto",
        help="auto: requests that omit temperature, top_p or top_k (chat: max_tokens) get the "
        "values of the checkpoint's generation_config.json, as in vLLM; serve refuses to start "
        "if the file sets one we do not implement (repetition_penalty, min_p, ...). none: "
        "ignore the file's sampling values and use ours (temperature 1, top_p 1, no top_k) "
        "(default auto)",
    )
    http.add_argument(
        "--responses-dir",
        type=Path,
        default=None,
        help="where /v1/responses keeps the responses it stores (store: true, OpenAI's "
        "default) for GET, DELETE and previous_response_id, across restarts "
        "(default: $DUALPATH_HOME/responses)",
    )
    http.add_argument(
        "--responses-max-count",
        type=positive_int,
        default=10_000,
        help="stored responses kept at most; the oldest are evicted beyond (default 10000)",
    )
    http.add_argument(
        "--responses-max-gb",
        type=positive_float,
        default=1.0,
        help="size of the stored responses at most, GB (1e9 bytes): each keeps its whole "
        "conversation; the oldest are evicted beyond (default 1)",
    )
    http.add_argument(
        "--shutdown-timeout-s",
        type=positive_float,
        default=10.0,
        help="on SIGINT/SIGTERM, how long open connections may take to close (default 10)",
    )
    _add_cluster_arguments(p.add_argument_group("cluster"))


def _add_cluster_arguments(group: argparse._ArgumentGroup) -> None:

    add_nodes_argument(group, default="1P2D")
    add_engines_per_node_argument(group, default=1)
    add_nodes_per_group_argument(group, default=1)
    add_mode_argument(group)
    add_read_path_argument(group)
    add_link_cap_arguments(group)
    group.add_argument(
        "--host-memory-gbps",
        type=non_negative_float,
        default=0.0,
        help="host memory bandwidth per node, Gbps: SPEC §5's M in the start-up check of the "
        "P/D ratio (default 0 = no check); no cap is applied, KV crossing host memory is "
        "already charged to the NIC it crosses",
    )
    add_engine_memory_arguments(group)
    add_decode_threads_argument(group, default_help="--threads")
    add_transport_argument(group)
    group.add_argument(
        "--scheduler-endpoint",
        default="tcp://127.0.0.1:0",
        help="where engines reach the scheduler (default tcp://127.0.0.1:0: loopback, a free "
        "port); e.g. tcp://0.0.0.0:5555 for engines on other hosts",
    )
    group.add_argument(
        "--external-engines",
        action="store_true",
        help="start no engine here: wait for `dualpath engine --scheduler ...` processes to "
        "join (needs $DUALPATH_CLUSTER_TOKEN, shared with them)",
    )
    group.add_argument(
        "--restart-engines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start an engine this server started again when it dies, under the same id, "
        "after 1, 2, 4, ... s; at most 5 times in 5 minutes (default on; "
        "--no-restart-engines leaves it dead)",
    )
    group.add_argument(
        "--engine-start-timeout-s",
        type=positive_float,
        default=None,
        help="how long start-up waits for every engine to join, then exits (default: 300 for "
        "the engines this server starts; with --external-engines no deadline: the server "
        "answers 503, /health naming the roles still missing, until they have joined)",
    )
    # NOTE: longer than the runtime's 5 s: a PE reports between the layers of a batch,
    # but one layer of a full 8K-token batch on a CPU takes a good part of a second, and
    # a remote engine's detection time is this (the scheduler checks every quarter).
    add_heartbeat_argument(group, default=10.0)
    group.add_argument(
        "--persist-wait-s",
        type=non_negative_float,
        default=5.0,
        help="a request whose cached prefix stops at a block a decode engine is still "
        "writing to the store (an agent's next turn) waits up to this long for the write "
        "instead of recomputing from there; 0 never waits (default 5)",
    )
    group.add_argument(
        "--session-retention-s",
        type=non_negative_float,
        default=300.0,
        help="a request naming an agent session (X-Session-Id, X-Dynamo-Session-ID or the "
        "body's session_id) goes to the decode engine of the session's last turn while it has "
        "room, and that engine keeps the session's KV blocks in the store, ahead of other "
        "blocks under capacity pressure, for this long after each turn; 0 turns sessions off "
        "(default 300: an idle prefix's lifetime in Anthropic's and OpenAI's prompt caches)",
    )
    group.add_argument(
        "--local-prefill-tokens",
        type=non_negative_int,
        default=0,
        help="conditional disaggregation: a request whose prompt the store misses by at most "
        "this many tokens (an agent's short append to its session) is prefilled on its decode "
        "engine, which decodes it on, with no prefill engine nor KV transfer; --engine vllm "
        "(a decode engine says whether it can); 0 disaggregates every request (default 0)",
    )
    group.add_argument(
        "--prefill-tokens-per-s",
        type=positive_float,
        default=2000.0,
        help="prompt tokens (cached + new) one prefill engine gets through per second on the "
        "served workload; the scheduler's beta, the work a PE may hold, is 5 s of it (SPEC "
        "§6). Too low leaves a PE idle while its requests' KV is read; `dualpath bench "
        "offline` measures it (prompt_tokens_per_busy_s) (default 2000)",
    )
    add_attention_quota_argument(group)
    group.add_argument(
        "--engine-log-dir",
        type=Path,
        default=None,
        help="engine processes' logs, engine-N.log each (default: a folder of this server's "
        "own, $DUALPATH_HOME/logs/serve-DATE-TIME-PID)",
    )


@dataclass(frozen=True, slots=True)
class OptionTable:
    """A parser's options by destination, and their defaults, detached from the parser."""

    actions: dict[str, argparse.Action]
    defaults: dict[str, Any]


def detach_defaults(parser: argparse.ArgumentParser) -> OptionTable:
    """Move every option's default out of ``parser`` (the namespace then holds only the
    options the command line gave) into the returned table."""
    actions, defaults = {}, {}
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if not action.option_strings or action.dest == "help":
            continue
        actions[action.dest] = action
        defaults[action.dest] = action.default
        action.default = argparse.SUPPRESS
    return OptionTable(actions, defaults)


def resolve(args: argparse.Namespace, table: OptionTable) -> argparse.Namespace:
    """Command line over config file over defaults; ``ValueError`` for a bad file."""
    given = {dest: value for dest, value in vars(args).items() if dest in table.actions}
    from_file = load_config_file(given["config"], table) if "config" in given else {}
    for dests in _EXCLUSIVE_DESTS:
        if any(dest in given for dest in dests):
            for dest in dests:
                from_file.pop(dest, None)
    if "vllm_arg" in given and "vllm_arg" in from_file:
        given["vllm_arg"] = from_file["vllm_arg"] + given["vllm_arg"]  # later keys win
    return argparse.Namespace(**{**table.defaults, **from_file, **given})


def load_config_file(path: Path, table: OptionTable) -> dict[str, Any]:
    """The file's settings by destination, converted and checked as their flags would be."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"config file {path}: cannot be read: {exc.strerror}") from exc
    raw = _parse(path, text)
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: expected a mapping of flag names to values")
    settings = {}
    for key, value in raw.items():
        dest = str(key).replace("-", "_")
        if dest in _VLLM_ARGS_KEYS and "vllm_arg" in table.actions:
            settings["vllm_arg"] = _vllm_args(path, key, value, table.actions["vllm_arg"])
            continue
        if dest not in table.actions or dest in _NOT_IN_FILE:
            known = ", ".join(sorted(d.replace("_", "-") for d in table.actions if d != "config"))
            raise ValueError(f"config file {path}: unknown key {key!r}; known keys: {known}")
        try:
            settings[dest] = _convert(table.actions[dest], value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            raise ValueError(f"config file {path}: {key}: {exc}") from exc
    return settings


def _vllm_args(path: Path, key: Any, value: Any, action: argparse.Action) -> list:
    """``(name, value)`` pairs of the file's vLLM arguments: a mapping (values as the file
    types them) or a list of ``KEY=VALUE`` strings (read as ``--vllm-arg`` reads them)."""
    if isinstance(value, dict):
        pairs = [(str(name).replace("-", "_"), item) for name, item in value.items()]
    elif isinstance(value, list) and all(isinstance(item, str) for item in value):
        try:
            pairs = [action.type(item) for item in value]
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"config file {path}: {key}: {exc}") from exc
    else:
        raise ValueError(
            f"config file {path}: {key}: expected a mapping of vLLM engine arguments to "
            f"values, or a list of KEY=VALUE strings, got {value!r}"
        )
    return pairs


def _parse(path: Path, text: str) -> Any:
    if Path(path).suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config file {path}: not valid JSON: {exc}") from exc
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # One line: the library's message draws the offending line with a caret below it.
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"config file {path}: not valid YAML{where}: {problem}") from exc


def _convert(action: argparse.Action, value: Any) -> Any:
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # on/off
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: the key is x
            return value
        return value if action.const is True else not value
    if value is None or isinstance(value, (bool, list, dict)):
        raise ValueError(f"expected a single value, got {value!r}")
    converted = action.type(str(value)) if action.type is not None else str(value)
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    return converted
