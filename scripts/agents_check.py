"""Real agent harnesses, unmodified, against `dualpath serve`: Claude Code (`claude -p`, the
Anthropic Messages API), Codex CLI (`codex exec`, the OpenAI Responses API) and mini-swe-agent
(chat completions through litellm). `make agents-check` installs them (npm and PyPI, pinned)
and runs this script.

Their prompts (system prompt and tool schemas) are 10K-20K tokens, past the embedded
SmolLM2's 8K context, so the server runs a protocol-test checkpoint: the `tiny` preset's random
weights with SmolLM2's real tokenizer and a 64K context (`make-model --tokenizer-from
--max-position-embeddings`). Its answers are noise: no harness can finish its task, and none is
asked to. What is checked is the protocol and the store:

- every API request a harness sent was answered 2xx, and each harness made at least
  ``--min-requests`` model requests (a conversation continued: `claude -p --continue`,
  `codex exec resume --last`, mini-swe-agent's own steps);
- from its second model request on, each read at least ``--min-cached-fraction`` of its prompt
  from the store (the server's own per-request log: ``cached_tokens`` of ``prompt_tokens``).

The checkpoint's generation_config.json caps an answer at ``ANSWER_TOKENS`` (64) tokens where a
request names no limit (Codex sends none): random weights rarely write an end token, and
noise up to the 64K context would only take time. Exits non-zero when a check fails; the JSON
result lists every request.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "dualpath-agent-test"
API_KEY = "agents-check-key"
CONTEXT_TOKENS = 65536
ANSWER_TOKENS = 64
HARNESSES = ("claude", "codex", "mini")
# mini-swe-agent's task: an issue report as SWE-bench gives it (its prompt is otherwise ~1K
# tokens). mini drops an answer cut off at max_tokens and sends its feedback instead, so step 2
# can reuse only step 1's prompt, in whole 64-token blocks: on a 1K-token prompt that bound is
# 0.898 of it, on this one about 0.95.
MINI_TASK = """\
Fix the bug reported below, in the repository in the current directory.

Title: `parse_duration` returns a wrong value for inputs with both hours and seconds

When I call `parse_duration("1h30s")` I expect 3630 seconds, but I get 5400. It looks like the
seconds part is treated as minutes when the minutes part is missing. Inputs with all three
parts (`"1h2m3s"` -> 3723) and with only one part (`"45s"` -> 45, `"2h"` -> 7200) work. The
function is in `timeparse.py`:

```python
import re

_PART = re.compile(r"(\\d+)([hms])")

def parse_duration(text):
    total = 0
    units = {"h": 3600, "m": 60, "s": 1}
    parts = _PART.findall(text)
    for index, (value, unit) in enumerate(parts):
        if unit == "s" and index == 1 and len(parts) == 2:
            unit = "m"
        total += int(value) * units[unit]
    return total
```

Traceback from our test suite:

```
FAILED tests/test_timeparse.py::test_hours_and_seconds - assert 5400 == 3630
 +  where 5400 = parse_duration('1h30s')
```

Expected behaviour: every part counts with its own unit, in any combination, and the empty
string is 0. Please also add a test for `"1h30s"`, `"90m"`, `"1h1m1s"` and `""`, and make sure
that a string with an unknown unit such as `"3d"` raises `ValueError` with a message that names
the unit, because silently ignoring it hid this bug from us for a month.
"""
_SUMMARY = re.compile(
    r"request_id=(?P<id>\w+) generations=\d+ prompt_tokens=(?P<prompt>\d+) "
    r"cached_tokens=(?P<cached>\d+) completion_tokens=(?P<completion>\d+)"
)
_ACCESS = re.compile(
    r"request_id=(?P<id>\w+) method=(?P<method>\w+) path=(?P<path>\S+) status=(?P<status>\d+)"
)


def main() -> int:
    args = _parse_args()
    work = Path(tempfile.mkdtemp(prefix="agents-check-"))
    model_dir = _make_checkpoint(work / "model")
    log_path = work / "server.log"
    server = _start_server(model_dir, work, log_path, args.port)
    results: dict[str, dict] = {}
    try:
        _wait_ready(args.port, server)
        for name in args.agents:
            start = log_path.stat().st_size
            harness_dir = work / name
            harness_dir.mkdir()
            print(f"--- {name}", flush=True)
            exit_codes = RUNNERS[name](args, harness_dir)
            time.sleep(1.0)  # the server logs a request's summary as its response ends
            requests = _requests_logged(log_path, start)
            results[name] = _judge(name, exit_codes, requests, args)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    ok = bool(results) and all(r["ok"] for r in results.values())
    report = {
        "ok": ok,
        "model": {
            "checkpoint": "tiny preset, random weights, SmolLM2-135M-Instruct's tokenizer",
            "context_tokens": CONTEXT_TOKENS,
            "answer_tokens_when_unlimited": ANSWER_TOKENS,
        },
        "min_cached_fraction": args.min_cached_fraction,
        "harnesses": results,
        "server_log": str(log_path),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    for name, result in results.items():
        fractions = ", ".join(f"{r['cached_fraction']:.3f}" for r in result["requests"])
        print(f"{name}: {'ok' if result['ok'] else 'FAILED'}; cached fractions [{fractions}]")
        for problem in result["problems"]:
            print(f"  {problem}")
    if not ok:
        print(f"agents check failed; the server's log: {log_path}", file=sys.stderr)
    return 0 if ok else 1


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--agents-dir",
        type=Path,
        default=ROOT / ".agents",
        help="where `make agents-check` installed the harnesses (node_modules/.bin/claude and "
        "codex, venv/bin/mini; default .agents)",
    )
    p.add_argument(
        "--agents",
        type=lambda s: [a for a in s.split(",") if a],
        default=list(HARNESSES),
        help=f"harnesses to run, comma-separated (default {','.join(HARNESSES)})",
    )
    p.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    p.add_argument(
        "--min-cached-fraction",
        type=float,
        default=0.9,
        help="what each model request after a harness's first must read from the store, as a "
        "fraction of its prompt (default 0.9)",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=2,
        help="model requests each harness must make (default 2)",
    )
    p.add_argument("--mini-steps", type=int, default=4, help="mini-swe-agent's step limit")
    p.add_argument("--timeout-s", type=float, default=600, help="per harness command")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args()
    args.agents_dir = args.agents_dir.resolve()  # the harnesses run in directories of their own
    if args.port == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    unknown = sorted(set(args.agents) - set(HARNESSES))
    if unknown:
        p.error(f"--agents: unknown {', '.join(unknown)}; choose from {', '.join(HARNESSES)}")
    return args


# --- the server -------------------------------------------------------------------------------


def _make_checkpoint(out: Path) -> Path:
    from dualpath.home import models_dir
    from dualpath.model.default import ensure_default_model
    from dualpath.model.make import make_model

    smollm2 = ensure_default_model(models_dir())
    make_model("tiny", out, tokenizer_from=smollm2, max_position_embeddings=CONTEXT_TOKENS)
    config_path = out / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["max_new_tokens"] = ANSWER_TOKENS
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return out


def _start_server(model_dir: Path, work: Path, log_path: Path, port: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "dualpath.cli", "--log-level", "INFO", "serve",
        "--model", str(model_dir),
        "--served-model-name", MODEL_NAME,
        "--api-key", API_KEY,
        "--port", str(port),
        "--kv-store", str(work / "kv"),
        "--engine-log-dir", str(work / "engines"),
    ]  # fmt: skip
    log = log_path.open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _wait_ready(port: int, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"dualpath serve exited with {server.returncode} while starting")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"dualpath serve was not ready in {timeout_s:.0f} s")


def _requests_logged(log_path: Path, start: int) -> list[dict]:
    """The API requests in the server's log after byte ``start``: path, status and (for
    generation) prompt and cached tokens, in order."""
    with log_path.open() as log:
        log.seek(start)
        text = log.read()
    summaries = {m["id"]: m for m in _SUMMARY.finditer(text)}
    requests = []
    for access in _ACCESS.finditer(text):
        if not access["path"].startswith("/v1/"):
            continue
        request = {"path": access["path"], "status": int(access["status"])}
        summary = summaries.get(access["id"])
        if summary is not None:
            prompt, cached = int(summary["prompt"]), int(summary["cached"])
            request |= {
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": int(summary["completion"]),
                "cached_fraction": cached / prompt,
            }
        requests.append(request)
    return requests


def _judge(name: str, exit_codes: list[int], requests: list[dict], args) -> dict:
    problems = []
    refused = [r for r in requests if not 200 <= r["status"] < 300]
    if refused:
        problems.append(f"{len(refused)} request(s) not answered 2xx: {refused[:3]}")
    model_requests = [r for r in requests if "prompt_tokens" in r]
    if len(model_requests) < args.min_requests:
        problems.append(f"{len(model_requests)} model request(s), fewer than {args.min_requests}")
    for index, request in enumerate(model_requests[1:], start=2):
        if request["cached_fraction"] < args.min_cached_fraction:
            problems.append(
                f"request {index} read {request['cached_tokens']} of "
                f"{request['prompt_tokens']} prompt tokens from the store "
                f"({request['cached_fraction']:.3f} < {args.min_cached_fraction})"
            )
    return {
        "ok": not problems,
        "exit_codes": exit_codes,
        "problems": problems,
        "requests": model_requests,
        "other_requests": [r for r in requests if "prompt_tokens" not in r],
    }


# --- the harnesses ----------------------------------------------------------------------------


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> int:
    print("$", " ".join(command), flush=True)
    try:
        done = subprocess.run(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, timeout=timeout_s,
            capture_output=True, text=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout_s:.0f} s")
        return -1
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    for line in tail:
        print(f"  | {line[:160]}")
    return done.returncode


def _tool(args: argparse.Namespace, *parts: str) -> str:
    path = args.agents_dir.joinpath(*parts)
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `make agents-check` (it installs the harnesses)")
    return str(path)


def _isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """A fresh HOME (no user settings, sessions or credentials leak in or out)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    return env | {"HOME": str(home), **extra}


def run_claude(args: argparse.Namespace, work: Path) -> list[int]:
    claude = _tool(args, "node_modules", ".bin", "claude")
    env = _isolated_env(
        work / "home",
        ANTHROPIC_BASE_URL=f"http://127.0.0.1:{args.port}",
        ANTHROPIC_API_KEY=API_KEY,
        ANTHROPIC_MODEL=MODEL_NAME,
        ANTHROPIC_SMALL_FAST_MODEL=MODEL_NAME,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL_NAME,
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(ANSWER_TOKENS),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
    )
    project = work / "project"
    project.mkdir()
    return [
        _run([claude, "-p", "List the files here.", "--model", MODEL_NAME], project, env,
             args.timeout_s),
        _run([claude, "-p", "--continue", "Now count them.", "--model", MODEL_NAME], project,
             env, args.timeout_s),
    ]  # fmt: skip


def run_codex(args: argparse.Namespace, work: Path) -> list[int]:
    codex = _tool(args, "node_modules", ".bin", "codex")
    codex_home = work / "home" / ".codex"
    codex_home.mkdir(parents=True)
    env = _isolated_env(work / "home", CODEX_HOME=str(codex_home), DUALPATH_API_KEY=API_KEY)
    provider = (
        f'{{name="dualpath",base_url="http://127.0.0.1:{args.port}/v1",wire_api="responses",'
        'env_key="DUALPATH_API_KEY",request_max_retries=0,stream_max_retries=0}'
    )
    options = [
        "--skip-git-repo-check", "-m", MODEL_NAME,
        "-c", "model_provider=dualpath", "-c", f"model_providers.dualpath={provider}",
        # Hosted tools that the server cannot run (it refuses them by name).
        "-c", "web_search=disabled", "-c", "features.multi_agent=false",
    ]  # fmt: skip
    project = work / "project"
    project.mkdir()
    return [
        _run([codex, "exec", *options, "List the files here."], project, env, args.timeout_s),
        _run([codex, "exec", *options, "resume", "--last", "Now count them."], project, env,
             args.timeout_s),
    ]  # fmt: skip


def run_mini(args: argparse.Namespace, work: Path) -> list[int]:
    mini = _tool(args, "venv", "bin", "mini")
    env = _isolated_env(
        work / "home",
        MSWEA_CONFIGURED="true",
        MSWEA_COST_TRACKING="ignore_errors",
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no fetch from the internet
    )
    project = work / "project"
    project.mkdir()
    command = [
        mini, "--yolo", "--exit-immediately",
        "-m", f"openai/{MODEL_NAME}",
        "-t", MINI_TASK,
        "-c", "mini.yaml",
        "-c", f"model.model_kwargs.api_base=http://127.0.0.1:{args.port}/v1",
        "-c", f"model.model_kwargs.api_key={API_KEY}",
        "-c", f"model.model_kwargs.max_tokens={ANSWER_TOKENS}",
        "-c", f"agent.step_limit={args.mini_steps}",
        "-o", str(work / "trajectory.json"),
    ]  # fmt: skip
    return [_run(command, project, env, args.timeout_s)]


RUNNERS = {"claude": run_claude, "codex": run_codex, "mini": run_mini}

if __name__ == "__main__":
    if shutil.which("node") is None:
        print("note: node is not on PATH; claude and codex need it", file=sys.stderr)
    sys.exit(main())
