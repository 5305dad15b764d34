"""Schema-driven fuzzing of a live `dualpath serve`: schemathesis reads the server's own
/openapi.json, sends requests that keep every rule it states and requests that break one, and
checks each answer against it.

    .venv/bin/pytest -q -s tests/server/test_fuzz.py    # -s prints the statuses per route
    make fuzz    # the same with DUALPATH_FUZZ_EXAMPLES=500: a deeper search, not in `make test`

It fails on a 5xx; an error body not in OpenAI's shape (Anthropic's on /v1/messages); a status
or media type the schema does not document; a request the schema forbids that is accepted
anyway; a keyed route that answers without the key; an undeclared method not answered 405 with
``Allow``; a request with no answer within REQUEST_TIMEOUT_S; and, after the fuzz, an engine
that is no longer alive.

Not checked: that every request the schema allows succeeds (schemathesis'
``positive_data_acceptance``). JSON Schema cannot state the rules across fields (the prompt and
max_tokens within the context, exactly one of prompt and messages on /tokenize, min_tokens at
most max_tokens, ...), so such a request may rightly get a 400.

Failures are recorded, not raised, so one bug does not hide the next within the fixed budget;
``test_no_failures_and_every_engine_alive`` (last) lists them, each with a curl command.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis
import pytest
import requests

from tests.server.serving import Server, auth, child_pids, is_running, start_server

pytest.importorskip("nixl_cu12")
schemathesis = pytest.importorskip("schemathesis")

# The server's limits, and so the schema's bounds: a small context keeps the costliest valid
# request (64 choices x 255 new tokens) to a few seconds on a CPU. The body limit stays the
# default (8 MiB): generated bodies of tens of KB must be judged on their contents, not sizes
# (a 413 is no answer to "is this invalid request rejected"; tests/server/test_api.py has 413).
MAX_MODEL_LEN = 256
# A request without an answer by then is a hang: far above the costliest request's few
# seconds, so a loaded machine is not mistaken for one.
REQUEST_TIMEOUT_S = 120.0
# Generated cases per route and mode, on top of the coverage phase's fixed set (boundary
# values, wrong types, missing fields, undeclared methods): 40-52 s in all on 2 cores since
# the agents' routes doubled the operations (20 s before), start-up included, in `make test`;
# `make fuzz` asks for more (DUALPATH_FUZZ_EXAMPLES).
MAX_EXAMPLES = int(os.environ.get("DUALPATH_FUZZ_EXAMPLES", "40"))
SEED = 0  # the same cases on every run
MAX_REPORTED_CHARS = 3000  # of each failure's message (it ends with the curl command)

CHECK_NAMES = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    # Strict only where the schema is: every documented error is an ErrorResponse; the 200
    # bodies are documented as any JSON object.
    "response_schema_conformance",
    "negative_data_rejection",
    "ignored_auth",  # resends the request without the key: it must get a 401
    "unsupported_method",
)
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class FuzzLog:
    """What the fuzz saw: statuses per route, and each distinct failure once."""

    path_to_status_counts: dict[str, Counter[str]] = field(default_factory=dict)
    key_to_failure: dict[tuple[str, str, str], str] = field(default_factory=dict)
    num_requests: int = 0
    duration_s: float = 0.0

    def count(self, path: str, status: int) -> None:
        self.path_to_status_counts.setdefault(path, Counter())[str(status)] += 1
        self.num_requests += 1

    def fail(self, label: str, kind: str, status: str, report: str) -> None:
        self.key_to_failure.setdefault((label, kind, status), report[:MAX_REPORTED_CHARS])


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz")
    with start_server(
        tiny_model_dir,
        root,
        "--max-model-len", str(MAX_MODEL_LEN),
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def api_schema(server: Server) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "headers": auth(),
            "request-timeout": REQUEST_TIMEOUT_S,  # also bounds the checks' own requests
            # Fields named *token* would be masked in the reports; there is no secret here.
            "output": {"sanitization": {"enabled": False}},
        }
    )
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


def test_fuzz_finds_no_failure_and_every_engine_survives(
    server: Server, api_schema: schemathesis.BaseSchema
) -> None:
    log = FuzzLog()
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    for operation in operations:
        for mode in schemathesis.GenerationMode:  # requests that keep the schema, and break it
            _fuzz(operation, mode, log)
    _report(server, log)


def _fuzz(operation, mode: schemathesis.GenerationMode, log: FuzzLog) -> None:
    """MAX_EXAMPLES cases of ``operation`` in ``mode``, each sent and checked."""

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases on every run
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],  # no shrinking
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        _send_and_check(case, log)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        # A route with no parameters and no body (GET /health) has no request to break.
        assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label


def _send_and_check(case: schemathesis.Case, log: FuzzLog) -> None:
    label = case.operation.label
    start_s = time.monotonic()
    try:
        response = case.call(timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as exc:  # a hang (timeout) or a server that went away
        log.fail(label, type(exc).__name__, "-", f"{exc}\n\n{case.as_curl_command()}")
        return
    finally:
        log.duration_s += time.monotonic() - start_s
    log.count(case.path, response.status_code)
    status = str(response.status_code)
    # The Messages API answers in Anthropic's shape, but for what fails before its routes: a
    # method it has no route for (405, from the router), a body over the limit (413).
    is_anthropic = case.path.startswith("/v1/messages") and response.status_code not in (405, 413)
    has_shape = _has_anthropic_error_shape if is_anthropic else _has_openai_error_shape
    if 400 <= response.status_code < 500 and not has_shape(response):
        body = response.text[:500]
        shape = "Anthropic's" if is_anthropic else "OpenAI's"
        log.fail(label, f"not {shape} error shape", status, f"{body}\n\n{case.as_curl_command()}")
    checks = [getattr(schemathesis.checks, name) for name in CHECK_NAMES]
    try:
        case.validate_response(response, checks=checks)
    except schemathesis.errors.FailureGroup as group:
        for failure in group.exceptions:
            log.fail(label, f"{failure.code} {failure.title}", status, str(group))
    except schemathesis.checks.Failure as failure:
        log.fail(label, failure.title, status, str(failure))


def _has_openai_error_shape(response: requests.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and isinstance(body["error"], dict)
        and set(body["error"]) == ERROR_KEYS
        and isinstance(body["error"]["message"], str)
        and isinstance(body["error"]["type"], str)
    )


def _has_anthropic_error_shape(response: requests.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and set(body) == {"type", "error"}
        and body["type"] == "error"
        and isinstance(body["error"], dict)
        and set(body["error"]) == {"type", "message"}
        and all(isinstance(value, str) for value in body["error"].values())
    )


def _report(server: Server, fuzz_log: FuzzLog) -> None:
    """Print the statuses per route; fail on any failure, an unhealthy server or a dead engine."""
    counts = {
        path: dict(sorted(c.items())) for path, c in sorted(fuzz_log.path_to_status_counts.items())
    }
    print(
        f"\nfuzz: {fuzz_log.num_requests} requests in {fuzz_log.duration_s:.1f} s; statuses per route:"
    )
    print(counts)
    assert fuzz_log.num_requests > 0, "the fuzz sent nothing"
    health = server.health()
    health_body = health.json() if health.status_code in (200, 503) else health.text
    children = child_pids(server.process.pid)
    dead = [pid for pid in children if not is_running(pid)]
    problems = [
        f"--- {label}: {kind} [{status}]\n{report}"
        for (label, kind, status), report in sorted(fuzz_log.key_to_failure.items())
    ]
    if health.status_code != 200 or (
        health_body["num_live_engines"] != health_body["num_expected_engines"]
    ):
        problems.append(f"--- /health after the fuzz: {health.status_code} {health_body}")
    if not children or dead:
        problems.append(f"--- engine processes: {children}, not running: {dead}")
    assert not problems, f"{len(problems)} distinct failures:\n" + "\n".join(problems)
