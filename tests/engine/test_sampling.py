from __future__ import annotations

import torch

from dualpath.engine.sampling import SamplingParams, make_generator, sample


def test_greedy_takes_argmax_and_reports_logprobs() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    token, logprob = sample(logits, SamplingParams(logprobs=2), None)
    assert token == 1
    expected = torch.log_softmax(logits, -1)
    assert logprob is not None
    assert abs(logprob.logprob - float(expected[1])) < 1e-6
    assert [t for t, _ in logprob.top] == [1, 3]


def test_banned_tokens_are_never_picked() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert sample(logits, SamplingParams(), None, banned_token_ids=(1,))[0] == 2


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([5.0, 4.9, 0.0, -1.0])
    for params in (
        SamplingParams(temperature=1.0, top_k=2, seed=0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=0),
    ):
        gen = make_generator(params)
        picks = {sample(logits, params, gen)[0] for _ in range(200)}
        assert picks == {0, 1}


def test_top_p_keeps_the_first_token_even_when_it_alone_exceeds_p() -> None:
    logits = torch.tensor([10.0, 0.0, 0.0])
    params = SamplingParams(temperature=1.0, top_p=0.1, seed=1)
    gen = make_generator(params)
    assert {sample(logits, params, gen)[0] for _ in range(50)} == {0}


def test_sampling_params_cross_the_wire_unchanged() -> None:
    from dualpath.types import sampling_params_from_dict, sampling_params_to_dict

    params = SamplingParams(max_tokens=9, temperature=0.5, stop=("x",), stop_token_ids=(3,), seed=4)
    wire = sampling_params_to_dict(params)
    wire["stop"] = list(wire["stop"])  # msgpack turns tuples into lists
    assert sampling_params_from_dict(wire) == params
    import pytest

    with pytest.raises(ValueError, match="unknown sampling fields"):
        sampling_params_from_dict({"max_tokens": 3, "bogus": 1})
