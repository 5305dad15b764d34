"""Soak: many concurrent multi-turn sessions against `dualpath serve` for a while; one JSON.

    python scripts/soak.py --sessions 256 --duration-s 600 --json results/soak.json
    python scripts/soak.py --url http://10.77.0.1:8000 --duration-s 60   # a running server

Each session replays an agent: a random first prompt, then turns of "everything so far plus a
short append", until its context passes --max-context-tokens, when it starts over. Without
--url the script starts `dualpath serve` (tiny model, 1P2D, store in a temp dir) and samples
its process tree every --sample-period-s: RSS per process, open file descriptors and the
entries of /dev/shm. Reported: requests, lost requests (no final response: an error status
other than 429, a timeout or a broken connection), the 429 rate, latency percentiles, RSS and
fd over time, and leaks (fd and RSS growth after warm-up, /dev/shm entries left after stop).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from dualpath.bench.server_process import ServerProcess
from dualpath.model.make import make_model

VOCAB_SIZE = 1024  # the tiny model's
KEEPALIVE_EXPIRY_S = 2.0
REQUEST_TIMEOUT_S = 300.0  # a request still unanswered after this counts as lost


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--url", help="a running server (then no process sampling)")
    parser.add_argument("--first-prompt-tokens", type=int, default=256)
    parser.add_argument("--append-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-context-tokens", type=int, default=1536)
    parser.add_argument("--sample-period-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("results/soak.json"))
    parser.add_argument("--server-log", type=Path, help="keep the server's log here")
    return parser.parse_args()


class Tally:
    def __init__(self) -> None:
        self.latencies_s: list[float] = []
        self.num_requests = 0
        self.num_429 = 0
        self.num_lost = 0
        self.num_sessions = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.lost_examples: list[str] = []

    def lost(self, why: str) -> None:
        self.num_lost += 1
        if len(self.lost_examples) < 10:
            self.lost_examples.append(why[:300])


async def run_session(
    client: httpx.AsyncClient, args: argparse.Namespace, rng: np.random.Generator,
    deadline_s: float, tally: Tally,
) -> None:  # fmt: skip
    context: list[int] = []
    while time.monotonic() < deadline_s:
        if not context or len(context) > args.max_context_tokens:
            context = rng.integers(0, VOCAB_SIZE, args.first_prompt_tokens).tolist()
            tally.num_sessions += 1
        body = {"model": "tiny", "prompt": context, "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        start_s = time.monotonic()
        tally.num_requests += 1
        try:
            response = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            elapsed_s = time.monotonic() - start_s
            tally.lost(f"{type(exc).__name__} after {elapsed_s:.1f} s: {exc!r}")
            context = []
            continue
        if response.status_code == 429:
            tally.num_429 += 1
            await asyncio.sleep(1.0)  # back off, then retry the same turn
            continue
        if response.status_code != 200:
            tally.lost(f"HTTP {response.status_code}: {response.text}")
            context = []
            continue
        tally.latencies_s.append(time.monotonic() - start_s)
        result = response.json()
        usage = result["usage"]
        tally.num_prompt_tokens += usage["prompt_tokens"]
        tally.num_cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
        append = rng.integers(0, VOCAB_SIZE, args.append_tokens).tolist()
        context = context + result["choices"][0]["token_ids"] + append


async def drive(url: str, args: argparse.Namespace, tally: Tally) -> float:
    # Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s) ends:
    # a request sent on a connection the server is closing that instant is never read.
    limits = httpx.Limits(max_connections=args.sessions + 8, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    rngs = [
        np.random.default_rng(s) for s in np.random.SeedSequence(args.seed).spawn(args.sessions)
    ]
    start_s = time.monotonic()
    deadline_s = start_s + args.duration_s
    client = httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S)
    async with client, asyncio.TaskGroup() as group:
        for rng in rngs:
            group.create_task(run_session(client, args, rng, deadline_s, tally))
    return time.monotonic() - start_s


def process_tree(root_pid: int) -> list[int]:
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root_pid], [root_pid]
    while frontier:
        children = [pid for pid, parent in parent_of.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def sample_tree(root_pid: int, start_s: float) -> dict:
    rss_bytes, num_fds = {}, 0
    for pid in process_tree(root_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            num_fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss_bytes[str(pid)] = int(line.split()[1]) * 1024
    return {
        "time_s": round(time.monotonic() - start_s, 1),
        "rss_bytes": rss_bytes,
        "total_rss_bytes": sum(rss_bytes.values()),
        "num_fds": num_fds,
        "num_shm_entries": len(os.listdir("/dev/shm")),
    }


class Sampler(threading.Thread):
    def __init__(self, root_pid: int, period_s: float) -> None:
        super().__init__(daemon=True)
        self.root_pid, self.period_s = root_pid, period_s
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        self.start_s = time.monotonic()

    def run(self) -> None:
        while True:
            self.samples.append(sample_tree(self.root_pid, self.start_s))
            if self.stop_event.wait(self.period_s):
                self.samples.append(sample_tree(self.root_pid, self.start_s))
                return


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(("p50", "p90", "p99", "max"))
    array = np.asarray(values)
    return {
        "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
        "max": float(array.max()),
    }


def leak_report(
    samples: list[dict], shm_before: set[str], shm_after: set[str], cluster_id: str
) -> dict:
    """Growth between the first sample after warm-up (a quarter of the run) and the last.

    /dev/shm is shared with every process on the machine: entries named after this cluster
    are its leaks; other new entries are listed apart (they may be anyone's).
    """
    new_entries = sorted(shm_after - shm_before)
    warm = samples[len(samples) // 4]
    last = samples[-1]
    return {
        "rss_after_warmup_bytes": warm["total_rss_bytes"],
        "rss_at_end_bytes": last["total_rss_bytes"],
        "rss_growth_ratio": last["total_rss_bytes"] / max(1, warm["total_rss_bytes"]),
        "fds_after_warmup": warm["num_fds"],
        "fds_at_end": last["num_fds"],
        "shm_entries_left_after_stop": [e for e in new_entries if cluster_id in e],
        "other_new_shm_entries": [e for e in new_entries if cluster_id not in e],
    }


def main() -> int:
    args = parse_args()
    tally = Tally()
    result: dict = {"config": {k: str(v) for k, v in vars(args).items()}}
    if args.url:
        result["wall_s"] = asyncio.run(drive(args.url, args, tally))
    else:
        token = secrets.token_hex(16)
        cluster_id = hashlib.sha256(token.encode()).hexdigest()[:12]  # as the engines name it
        shm_before = set(os.listdir("/dev/shm"))
        with tempfile.TemporaryDirectory(prefix="dualpath-soak-") as tmp:
            root = Path(tmp)
            model_dir = make_model("tiny", root / "tiny")  # the soak is sized for it
            serve_args = ["--model", str(model_dir), "--served-model-name", "tiny",
                          "--kv-store", str(root / "kv"),
                          "--engine-log-dir", str(root / "logs")]  # fmt: skip
            server = ServerProcess(
                serve_args,
                log_path=root / "server.log",
                env={"DUALPATH_HOME": str(root), "DUALPATH_CLUSTER_TOKEN": token},
            ).start()
            try:
                sampler = Sampler(server.pid, args.sample_period_s)
                sampler.start()
                result["wall_s"] = asyncio.run(drive(server.url, args, tally))
                sampler.stop_event.set()
                sampler.join()
            finally:
                result["server_exit_code"] = server.stop()
                if args.server_log:
                    shutil.copy(root / "server.log", args.server_log)
        shm_after = set(os.listdir("/dev/shm"))
        result["samples"] = sampler.samples
        result["leaks"] = leak_report(sampler.samples, shm_before, shm_after, cluster_id)
    num_answered = len(tally.latencies_s)
    result.update(
        num_requests=tally.num_requests,
        num_ok=num_answered,
        num_429=tally.num_429,
        rate_429=tally.num_429 / max(1, tally.num_requests),
        num_lost=tally.num_lost,
        lost_examples=tally.lost_examples,
        num_sessions_started=tally.num_sessions,
        requests_per_s=num_answered / result["wall_s"],
        cached_token_ratio=tally.num_cached_tokens / max(1, tally.num_prompt_tokens),
        latency_s=percentiles(tally.latencies_s),
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("samples", "config")}
    print(json.dumps(summary, indent=2))
    return 0 if tally.num_lost == 0 and result["rate_429"] < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
