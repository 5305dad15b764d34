"""Schema-driven fuzzing of a live `dualpath serve`: schemathesis reads the server's own
/openapi.json, sends requests that keep every rule it states and requests that break one, and
checks each answer against it.

    .venv/bin/pytest -q -s tests/server/test_fuzz.py    # -s prints the statuses per route

It fails on a 5xx; an error body not in OpenAI's shape; a status or media type the schema does
not document; a request the schema forbids that is accepted anyway; a keyed route that answers
without the key; an undeclared method not answered 405 with ``Allow``; a request with no answer
within REQUEST_TIMEOUT_S; and, after the fuzz, an engine that is no longer alive.

Not checked: that every request the schema allows succeeds (schemathesis'
``positive_data_acceptance``). JSON Schema cannot state the rules across fields (the prompt and
max_tokens within the context, exactly one of prompt and messages on /tokenize, min_tokens at
most max_tokens, ...), so such a request may rightly get a 400.

Every phase runs to the end (failures do not stop it), so one bug does not hide the next; the
test then lists each distinct failure once, with a curl command that reproduces it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

from tests.server.serving import Server, auth, child_pids, is_running, start_server

pytest.importorskip("nixl_cu12")
schemathesis = pytest.importorskip("schemathesis")
from schemathesis.engine import events  # noqa: E402  (after the skip: an optional package)

# The server's limits, and so the schema's bounds: a small context keeps the costliest valid
# request (64 choices x 255 new tokens) to a few seconds on a CPU.
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 32_768
REQUEST_TIMEOUT_S = 30.0
# Generated cases per route and generation mode, on top of the coverage phase's fixed set
# (boundary values, wrong types, missing fields, undeclared methods).
MAX_EXAMPLES = 40
SEED = 0  # the same requests on every run
MAX_REPORT_CHARS = 1500  # of each failure's report

CHECK_NAMES = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    # As strict as the schema: every documented error is an ErrorResponse, every 200 body is
    # documented as any JSON (or as text for streams and /metrics).
    "response_schema_conformance",
    "negative_data_rejection",
    "ignored_auth",  # resends a request without the key: it must get a 401
    "unsupported_method",
)
# What a request the schema forbids may get. 413 is not among schemathesis' defaults: a body
# over the limit is refused before it is read.
REJECTION_STATUSES = [400, 401, 404, 405, 413]
ERROR_KEYS = {"message", "type", "param", "code"}
# JSON may carry a lone UTF-16 surrogate ("\ud800"), and Python's json.dumps sends one for a
# str that holds it; schemathesis draws only strings UTF-8 can encode, so a hook adds them.
LONE_SURROGATES = ("\ud800", "\udfff")


@dataclass
class FuzzReport:
    """Statuses per route, and each distinct failure with the routes it was seen on."""

    path_to_status_counts: dict[str, Counter[str]] = field(default_factory=dict)
    kind_to_routes: dict[str, set[str]] = field(default_factory=dict)
    kind_to_example: dict[str, str] = field(default_factory=dict)
    num_requests: int = 0

    def count(self, path: str, status: str) -> None:
        self.path_to_status_counts.setdefault(path, Counter())[status] += 1
        self.num_requests += 1

    def fail(self, kind: str, route: str, example: str) -> None:
        self.kind_to_routes.setdefault(kind, set()).add(route)
        self.kind_to_example.setdefault(kind, example[:MAX_REPORT_CHARS])

    def describe_failures(self) -> list[str]:
        return [
            f"--- {kind} on {', '.join(sorted(routes))}\n{self.kind_to_example[kind]}"
            for kind, routes in sorted(self.kind_to_routes.items())
        ]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz")
    with start_server(
        tiny_model_dir,
        root,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-bytes", str(MAX_REQUEST_BYTES),
    ) as server:  # fmt: skip
        yield server


def load_schema(server: Server) -> schemathesis.BaseSchema:
    checks: dict[str, Any] = {"enabled": False}
    checks.update({name: {"enabled": True} for name in CHECK_NAMES})
    checks["negative_data_rejection"]["expected-statuses"] = REJECTION_STATUSES
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "headers": auth(),
            "request-timeout": REQUEST_TIMEOUT_S,
            "continue-on-failure": True,
            "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
            "generation": {"max-examples": MAX_EXAMPLES, "no-shrink": True, "database": "none"},
            "checks": checks,
            # Fields named *token* would be masked in the reports; there is no secret here.
            "output": {"sanitization": {"enabled": False}},
        }
    )
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)
    schema.hook(flatmap_body)
    return schema


def flatmap_body(context: Any, body: Any) -> st.SearchStrategy:
    """The generated body, or the body with one of its strings ending in a lone surrogate."""
    paths = list(_string_paths(body, ()))
    return st.one_of(
        st.just(body),
        st.sampled_from(paths or [None]).flatmap(
            lambda path: st.sampled_from([_append_at(body, path, s) for s in LONE_SURROGATES])
            if path is not None
            else st.just(body)
        ),
    )


def _string_paths(value: Any, path: tuple) -> Iterator[tuple]:
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _string_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _string_paths(item, (*path, index))


def _append_at(value: Any, path: tuple, suffix: str) -> Any:
    """A copy of ``value`` whose string at ``path`` ends with ``suffix``."""
    if not path:
        return value + suffix
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _append_at(value[head], rest, suffix)}
    return [_append_at(item, rest, suffix) if i == head else item for i, item in enumerate(value)]


def run_fuzz(schema: schemathesis.BaseSchema) -> FuzzReport:
    report = FuzzReport()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            _record_scenario(report, event.recorder)
        elif isinstance(event, events.NonFatalError):
            report.fail(f"error: {event.info.title}", event.label, str(event.info.message))
        elif isinstance(event, events.FatalError):
            report.fail("fatal error", "-", repr(event.exception))
    return report


def _record_scenario(report: FuzzReport, recorder: Any) -> None:
    route = recorder.label
    for case_id, interaction in recorder.interactions.items():
        case = recorder.cases[case_id].value
        response = interaction.response
        if response is None:  # no answer: a timeout or a refused connection
            report.count(case.path, "no answer")
            report.fail("no answer", route, case.as_curl_command())
            continue
        report.count(case.path, str(response.status_code))
        if 400 <= response.status_code < 500 and not _has_openai_error_shape(response.content):
            example = f"{response.status_code}: {response.content[:300]!r}\n{case.as_curl_command()}"
            report.fail("4xx not in OpenAI's error shape", route, example)
    for nodes in recorder.checks.values():
        for node in nodes:
            if node.failure_info is not None:
                failure = node.failure_info.failure
                example = f"{failure.message}\n{node.failure_info.code_sample}"
                report.fail(f"{failure.code} {failure.title}", route, example)


def _has_openai_error_shape(content: bytes) -> bool:
    try:
        body = json.loads(content)
    except ValueError:
        return False
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)):
        return False
    error = body["error"]
    return (
        set(error) == ERROR_KEYS
        and isinstance(error["message"], str)
        and isinstance(error["type"], str)
        and all(error[key] is None or isinstance(error[key], str) for key in ("param", "code"))
    )


def test_fuzz_every_route(server: Server) -> None:
    start_s = time.monotonic()
    report = run_fuzz(load_schema(server))
    duration_s = time.monotonic() - start_s
    counts = {p: dict(sorted(c.items())) for p, c in sorted(report.path_to_status_counts.items())}
    print(f"\nfuzz: {report.num_requests} requests in {duration_s:.1f} s, statuses per route:")
    print(json.dumps(counts))
    problems = report.describe_failures()
    health = server.health()
    body = health.json() if health.headers.get("content-type") == "application/json" else {}
    if health.status_code != 200 or body["num_live_engines"] != body["num_expected_engines"]:
        problems.append(f"--- /health after the fuzz: {health.status_code} {health.text}")
    engine_pids = child_pids(server.process.pid)
    dead_pids = [pid for pid in engine_pids if not is_running(pid)]
    if not engine_pids or dead_pids:
        problems.append(f"--- engine processes {engine_pids}, not running: {dead_pids}")
    assert report.num_requests > 0
    assert not problems, f"{len(problems)} distinct failures:\n" + "\n".join(problems)
