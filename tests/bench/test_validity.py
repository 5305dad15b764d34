"""Valid or fail: a run with failed requests, an incomplete mode or tokens that differ between
modes exits non-zero, says why, and writes ``"valid": false`` with no ratios.

The end-to-end cases run ``dualpath bench offline --url`` against a small fake of the
OpenAI-compatible completions API (``fake_server.py``: the benchmark's real client, no
engines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.bench.offline import finish_report
from dualpath.bench.validity import mode_problems
from dualpath.cli import main
from tests.bench.fake_server import fake_completions_server

TRACE = Path(__file__).parents[1] / "workload" / "data" / "agentic_head.jsonl"


def _bench_url(url: str, model_dir: Path, out: Path) -> int:
    return main(
        ["bench", "offline", "--url", url, "--model", str(model_dir), "--json", str(out)]
        + ["--trace", str(TRACE), "--length-scale", "0.01", "--max-turns", "4"]
        + ["--gen-scale", "0.5", "--clones", "1"]
    )


def test_a_run_with_failed_requests_exits_non_zero_and_says_why(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "broken.json"
    # Every session's turn 1 (a clone's turn 2, after its fresh first turn) is over 400
    # tokens at this scale: the fake refuses it, as a server refuses a prompt over its limit.
    with fake_completions_server(max_prompt_tokens=400) as server:
        assert _bench_url(server.url, tiny_model_dir, out) == 1
    report = json.loads(out.read_text())
    result = report["modes"]["url"]
    assert report["valid"] is False and "ratios" not in report
    assert result["num_failed"] == 4 and result["is_complete"] is False
    assert {(e["session"], e["turn"]) for e in result["first_errors"]} == {
        ("trace_0008", 1),
        ("trace_0182", 1),
        ("trace_0008+clone0", 2),
        ("trace_0182+clone0", 2),
    }
    err = capsys.readouterr().err
    assert "invalid run" in err and "url: 4 of 10 requests failed" in err
    assert "turn 1: TurnFailed: HTTP 400" in err
    assert "INVALID RUN" in (tmp_path / "broken.md").read_text()


def test_a_clean_run_is_valid_and_records_its_shaping(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "clean.json"
    with fake_completions_server(max_prompt_tokens=10_000) as server:
        assert _bench_url(server.url, tiny_model_dir, out) == 0
    report = json.loads(out.read_text())
    assert report["valid"] is True and report["problems"] == []
    assert report["modes"]["url"]["num_failed"] == 0
    shaping = report["shaping"]
    assert shaping["trace"] == str(TRACE) and shaping["turn_scale"] is None
    assert (shaping["length_scale"], shaping["max_turns"], shaping["gen_scale"]) == (0.01, 4, 0.5)
    assert shaping["clones"] == 1
    # 2 sessions of 4 turns, each with a clone of 5 turns (the fresh first turn).
    assert report["workload"]["num_sessions"] == 4
    assert report["modes"]["url"]["num_requests"] == 2 * 4 + 2 * 5
    assert report["workload"]["block_size_tokens"] == 64
    assert 0 < report["workload"]["ideal_hit_ratio"] < 1


def _result(jct_s: float, tokens: dict[str, str], num_failed: int = 0) -> dict:
    first_errors = [{"session": "s0", "turn": 1, "error": "HTTP 500"}] if num_failed else []
    return {
        "jct_s": jct_s,
        "num_requests": len(tokens) + num_failed,
        "num_turns_expected": len(tokens) + 2 * num_failed,
        "num_failed": num_failed,
        "is_complete": not num_failed,
        "first_errors": first_errors,
        "tokens": tokens,
    }


def test_scripted_results_give_ratios_only_when_every_mode_is_clean() -> None:
    same = {"s0/0": "a", "s0/1": "b"}
    clean = finish_report(
        {"modes": {"basic": _result(4.0, same), "oracle": _result(2.0, same)}},
        ["basic", "oracle"],
    )
    assert clean["valid"] is True and clean["ratios"]["oracle_vs_basic_jct"] == 2.0
    differ = finish_report(
        {
            "modes": {
                "basic": _result(4.0, same),
                "oracle": _result(2.0, {"s0/0": "a", "s0/1": "x"}),
            }
        },
        ["basic", "oracle"],
    )
    assert differ["valid"] is False and differ["ratios"] == {}
    assert differ["problems"] == ["oracle: 1 turns generated other tokens than basic"]
    failed = finish_report(
        {"modes": {"basic": _result(4.0, same), "oracle": _result(2.0, {"s0/0": "a"}, 1)}},
        ["basic", "oracle"],
    )
    assert failed["valid"] is False and failed["ratios"] == {}
    assert failed["problems"][0].startswith("oracle: 1 of 2 requests failed")
    assert "session s0 turn 1: HTTP 500" in failed["problems"][0]


def test_hit_kv_read_must_be_what_the_cached_tokens_hold() -> None:
    same = {"s0/0": "a"}

    def result(pe: int, de: int) -> dict:
        return {**_result(2.0, same), "cached_tokens": 128, "path_bytes": {"pe": pe, "de": de}}

    model = {"kv_bytes_per_token": 1280}
    exact = finish_report(
        {"model": model, "modes": {"basic": result(163840, 0), "dualpath": result(40960, 122880)}},
        ["basic", "dualpath"],
    )
    assert exact["valid"] is True
    short = finish_report(
        {"model": model, "modes": {"basic": result(163840, 0), "dualpath": result(0, 81920)}},
        ["basic", "dualpath"],
    )
    assert short["problems"] == [
        "dualpath: the sides read 81920 B of hit KV, but 128 cached tokens hold 163840 B "
        "(1280 B per token)"
    ]


def test_hit_kv_a_vllm_engine_held_counts_beside_what_the_sides_read() -> None:
    same = {"s0/0": "a"}
    model = {"kv_bytes_per_token": 1280}

    def result(pe: int, de: int, held: int) -> dict:
        return {
            **_result(2.0, same),
            "cached_tokens": 128,
            "path_bytes": {"pe": pe, "de": de},
            "engine_cached_bytes": held,
        }

    exact = finish_report({"model": model, "modes": {"basic": result(81920, 0, 81920)}}, ["basic"])
    assert exact["valid"] is True
    double = finish_report(
        {"model": model, "modes": {"basic": result(163840, 0, 81920)}}, ["basic"]
    )
    assert double["problems"] == [
        "basic: the sides read 163840 B of hit KV (and 81920 B the engine held), but 128 "
        "cached tokens hold 163840 B (1280 B per token)"
    ]


def test_hit_kv_is_checked_against_the_servers_count_of_store_hits_where_it_gives_one() -> None:
    # A front door before vLLM servers: each answer's cached_tokens is the server's own count
    # (the KV its connector loaded, the PE's prefill included), not the store's hits.
    same = {"s0/0": "a"}
    model = {"kv_bytes_per_token": 1280}

    def result(store_hit_tokens: int) -> dict:
        return {
            **_result(2.0, same),
            "cached_tokens": 200,
            "store_hit_tokens": store_hit_tokens,
            "path_bytes": {"pe": 81920, "de": 81920},
        }

    assert finish_report({"model": model, "modes": {"basic": result(128)}}, ["basic"])["valid"]
    wrong = finish_report({"model": model, "modes": {"basic": result(64)}}, ["basic"])
    assert wrong["problems"] == [
        "basic: the sides read 163840 B of hit KV, but 64 cached tokens hold 81920 B "
        "(1280 B per token)"
    ]


def test_hit_kv_counts_the_reads_of_requests_a_front_door_placed_again() -> None:
    # A placement lost and made again reads its hits again: 128 tokens at the first
    # placements, 64 more at the later ones.
    same = {"s0/0": "a"}
    model = {"kv_bytes_per_token": 1280}

    def result(pe: int, replaced_hit_tokens: int) -> dict:
        return {
            **_result(2.0, same),
            "cached_tokens": 200,
            "store_hit_tokens": 128,
            "replaced_hit_tokens": replaced_hit_tokens,
            "forwarded_replacements": 1,
            "path_bytes": {"pe": pe, "de": 81920},
        }

    exact = finish_report({"model": model, "modes": {"basic": result(163840, 64)}}, ["basic"])
    assert exact["valid"] is True
    uncounted = finish_report({"model": model, "modes": {"basic": result(163840, 0)}}, ["basic"])
    assert uncounted["problems"] == [
        "basic: the sides read 245760 B of hit KV, but 128 cached tokens hold 163840 B "
        "(1280 B per token)"
    ]
    short = finish_report({"model": model, "modes": {"basic": result(81920, 64)}}, ["basic"])
    assert short["problems"] == [
        "basic: the sides read 163840 B of hit KV, but 128 cached tokens (and 64 of placements "
        "made again) hold 245760 B (1280 B per token)"
    ]


def test_a_nic_whose_counters_and_our_accounting_disagree_makes_the_mode_invalid() -> None:
    def row(counters: int, ours: int, protocol: int = 0) -> dict:
        expected = ours + protocol
        return {
            "link": "node1.snic",
            "counters_bytes": counters,
            "our_bytes": ours,
            "protocol_bytes": protocol,
            "ratio": counters / expected if expected else None,
        }

    agreeing = {
        "decode-1.storage": row(104_000_000, 90_000_000, 13_000_000),  # 1.0097
        "decode-2.storage": row(210, 0),  # keep-alive pings of an idle NIC
        "prefill-0.compute": row(0, 0),
    }
    assert mode_problems("dualpath", {"nic_agreement": agreeing}) == []
    (problem,) = mode_problems(
        "dualpath",
        {"nic_agreement": {**agreeing, "prefill-0.storage": row(108_000_000, 100_000_000)}},
    )
    assert "prefill-0.storage" in problem and "ratio 1.08" in problem
    (problem,) = mode_problems("basic", {"nic_agreement": {"decode-1.compute": row(5_000_000, 0)}})
    assert "ratio None" in problem
