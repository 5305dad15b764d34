"""IncrementalDetokenizer with the embedded model's real byte-level BPE tokenizer: streamed
deltas add up to the final text, which is cut exactly where the engine cuts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.model.tokenizer import Tokenizer
from dualpath.server.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir / "tokenizer.json")


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], finish_reason: str):
    deltas = [detokenizer.push([t]) for t in token_ids]
    deltas.append(detokenizer.finish(finish_reason))
    return deltas


def test_deltas_add_up_to_the_decoded_text_across_split_characters(tokenizer: Tokenizer) -> None:
    text = "naïve café ✓ 日本語 🚀 done"
    token_ids = tokenizer.encode(text)
    # Byte-level BPE over a small vocabulary splits the multi-byte characters across tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    deltas = stream(IncrementalDetokenizer(tokenizer), token_ids, "length")
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)  # never half a character


def test_stop_string_cuts_the_text_and_is_never_streamed(tokenizer: Tokenizer) -> None:
    text = "alpha beta STOP gamma"
    token_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=("STOP", "zzz"))
    streamed = ""
    for i, token_id in enumerate(token_ids):
        streamed += detokenizer.push([token_id])
        assert "STOP"[:2] not in streamed, f"held-back text leaked after token {i}"
        if "STOP" in tokenizer.decode(token_ids[: i + 1]):  # where the engine would stop
            break
    streamed += detokenizer.finish("stop")
    assert streamed == "alpha beta "
    assert detokenizer.text == "alpha beta "
    assert detokenizer.stop_string == "STOP"  # Anthropic's stop_sequence


def test_the_stop_string_met_is_the_first_in_the_text(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("one two three")
    for stop, expected in [(("three", "two"), "two"), (("two thr", "two"), "two")]:
        detokenizer = IncrementalDetokenizer(tokenizer, stop=stop)
        assert "".join(stream(detokenizer, token_ids, "stop")) == "one "
        assert detokenizer.stop_string == expected
    detokenizer = IncrementalDetokenizer(tokenizer, stop=("zzz",))
    stream(detokenizer, token_ids, "stop")  # stopped by a token: no stop string met
    assert detokenizer.stop_string is None


def test_a_final_stop_token_is_not_text_but_stays_a_token(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    token_ids = [*tokenizer.encode("hello there"), eos]
    detokenizer = IncrementalDetokenizer(tokenizer, stop_token_ids={eos})
    deltas = stream(detokenizer, token_ids, "stop")
    assert "".join(deltas) == "hello there"
    assert detokenizer.token_ids == token_ids


def test_a_stop_token_that_did_not_stop_the_request_is_text(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    token_ids = [*tokenizer.encode("a"), eos, *tokenizer.encode(" b")]
    deltas = stream(IncrementalDetokenizer(tokenizer, stop_token_ids={eos}), token_ids, "length")
    assert "".join(deltas) == "a<|im_end|> b"


def test_push_after_finish_is_a_caller_bug(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.finish("length")
    with pytest.raises(RuntimeError, match="after finish"):
        detokenizer.push([1])
