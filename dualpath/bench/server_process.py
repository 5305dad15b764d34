"""`dualpath serve` as a child process for the benchmarks, and a sampler of its /metrics.

    with ServerProcess(["--mode", "dualpath", "--nodes", "1P2D"], log_path=log) as server:
        with MetricsSampler(server.url, period_s=0.5) as sampler:
            ... drive server.url with HTTP clients ...
        samples = sampler.samples

The benchmarks measure the system the way users run it: a real server process, reached over
HTTP. The server picks nothing here: the port is chosen free on loopback just before start
(another process could take it in between; start then fails with the server's log).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dualpath.bench.stats import LinkSample
from dualpath.lifetime import die_with_parent


class ChildServer:
    """An HTTP server as a child process on 127.0.0.1 (its argv from ``argv(port)``);
    ``start`` returns once ``GET /health`` answers 200."""

    name = "server"
    # Started again on the port it had (its address is in others' configuration).
    keeps_port = False

    def __init__(self, *, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.env = env
        self.port = 0
        self._process: subprocess.Popen | None = None

    def argv(self, port: int) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server's process id (its engines are its children)."""
        if self._process is None:
            raise RuntimeError("caller bug: the server has not been started")
        return self._process.pid

    def start(self, timeout_s: float = 180.0) -> ChildServer:
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process (on a free port) without waiting for it: several servers that
        start slowly can then start together."""
        self.port = self.port if self.keeps_port and self.port else _free_port()
        argv = self.argv(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                preexec_fn=self.preexec,
            )

    @staticmethod
    def preexec() -> None:
        """In the child before it runs: a killed benchmark leaves no server running."""
        die_with_parent()

    def wait_ready(self, timeout_s: float = 180.0) -> ChildServer:
        """Wait until ``GET /health`` answers 200; stop it and raise if it exits or times out."""
        assert self._process is not None, "caller bug: the server has not been launched"
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._process.returncode} during start-up:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} not healthy in {timeout_s} s:\n" + self.log_tail())
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the server's clean stop), then SIGKILL after ``timeout_s``; the exit code."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> ChildServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(ChildServer):
    """A ``dualpath serve`` child on 127.0.0.1."""

    name = "dualpath serve"

    def __init__(
        self,
        serve_args: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        log_level: str | None = None,
    ) -> None:
        """``log_level``: the CLI's ``--log-level`` (None: its default)."""
        super().__init__(log_path=log_path, env=env)
        self.serve_args = list(serve_args)
        self.api_key = api_key
        self.log_level = log_level

    def argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "dualpath.cli"]
        if self.log_level is not None:
            argv += ["--log-level", self.log_level]
        argv += ["serve", "--host", "127.0.0.1", "--port", str(port), *self.serve_args]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        return argv


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(
    url: str, *, timeout_s: float = 5.0, client: httpx.Client | None = None
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``GET url/metrics``: each sample name -> its ``(labels, value)`` pairs. Pass a
    ``client`` when scraping repeatedly: a new one builds an SSL context (~10 ms of CPU)."""
    text = (client or httpx).get(f"{url}/metrics", timeout=timeout_s).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def metric_sum(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0.0 if none)."""
    return sum(
        value
        for sample_labels, value in samples.get(name, ())
        if all(sample_labels.get(k) == v for k, v in labels.items())
    )


def snic_totals(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, int]:
    """Cumulative bytes per SNIC (all traffic classes) from one scrape."""
    totals: dict[str, int] = {}
    for labels, value in samples.get("dualpath_link_bytes_total", ()):
        link = labels.get("link", "")
        if link.endswith(".snic"):
            totals[link] = totals.get(link, 0) + int(value)
    return totals


def snic_read_totals(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, int]:
    """Cumulative hit-KV read bytes per SNIC from one scrape."""
    return {
        labels["link"]: int(value)
        for labels, value in samples.get("dualpath_snic_read_bytes_total", ())
        if "link" in labels
    }


FINAL_SAMPLE_DELAY_S = 0.5


class MetricsSampler:
    """Scrapes /metrics every ``period_s`` on a thread: SNIC byte samples for the load balance,
    and the last scrape. A failed scrape is skipped (the run goes on; fewer samples)."""

    def __init__(self, url: str, *, period_s: float = 0.5) -> None:
        self.url = url
        self.period_s = period_s
        self.samples: list[LinkSample] = []
        self.last: dict[str, list[tuple[dict[str, str], float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)
        # One client for every scrape: it keeps the connection, and building one per scrape
        # cost the benchmark a third of its CPU (an SSL context each time), on the cores the
        # cluster under test shares.
        self._client = httpx.Client()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                return

    def sample(self) -> None:
        now_s = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            self.last = scrape(self.url, client=self._client)
            self.samples.append(
                LinkSample(now_s, snic_totals(self.last), snic_read_totals(self.last))
            )

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        # The final counters: engines report a change within 10 ms and the server
        # republishes their counters every 0.1 s, so wait that out before reading the run's
        # totals.
        time.sleep(FINAL_SAMPLE_DELAY_S)
        self.sample()
        self._client.close()
