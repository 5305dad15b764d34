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


# --- values a request may carry never make the sampler raise ------------------------------


def test_a_temperature_below_the_greedy_threshold_is_greedy() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    for temperature in (1e-300, 1e-40, 1e-6):
        params = SamplingParams(temperature=temperature, seed=0)
        assert params.is_greedy
        assert make_generator(params) is None
        assert sample(logits, params, None)[0] == 1


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0])
    params = SamplingParams(temperature=1.0, top_p=1e-300, seed=0)
    assert {sample(logits, params, make_generator(params))[0] for _ in range(20)} == {1}


def test_unusable_probabilities_fall_back_to_the_argmax() -> None:
    nan_logits = torch.tensor([float("nan"), 1.0, 2.0])
    params = SamplingParams(temperature=1.0, seed=0)
    assert sample(nan_logits, params, make_generator(params))[0] == 2
    # Infinite logits: softmax gives NaN.
    inf_logits = torch.tensor([float("inf"), float("inf"), 0.0])
    assert sample(inf_logits, params, make_generator(params))[0] in (0, 1)


def test_a_ban_of_every_token_or_of_ids_outside_the_row_is_harmless() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert sample(logits, SamplingParams(), None, banned_token_ids=(0, 1, 2))[0] == 1
    assert sample(logits, SamplingParams(), None, banned_token_ids=(1, 7, 1 << 40))[0] == 2
    params = SamplingParams(temperature=1.0, top_k=1 << 40, seed=0)
    assert sample(logits, params, make_generator(params))[0] in (0, 1, 2)


def test_min_tokens_bans_end_and_stop_tokens_until_reached() -> None:
    from dualpath.engine.sampling import banned_token_ids

    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(5,))
    assert banned_token_ids(params, 0, (2,)) == (2, 5)
    assert banned_token_ids(params, 2, (2,)) == (2, 5)
    assert banned_token_ids(params, 3, (2,)) == ()
    ignoring = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(5,), ignore_eos=True)
    assert banned_token_ids(ignoring, 0, (2,)) == (5,)


def test_sampling_params_refuse_values_the_wire_cannot_carry() -> None:
    import pytest

    for bad in (
        {"top_k": 1 << 64},
        {"seed": 1 << 63},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"stop_token_ids": (1 << 31,)},
        {"max_tokens": 1 << 64},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_seeded_requests_token_i_is_drawn_the_same_whatever_came_before() -> None:
    # Any engine samples output token i alike: the PE the first, a DE the rest, another DE
    # after a loss (make_generator(params, i) depends on the seed and i only).
    logits = torch.linspace(0.0, 1.0, 50)
    params = SamplingParams(temperature=1.0, seed=11)
    draws = [sample(logits, params, make_generator(params, i))[0] for i in range(20)]
    again = [sample(logits, params, make_generator(params, i))[0] for i in reversed(range(20))]
    assert draws == again[::-1]
    assert len(set(draws)) > 5  # each token its own draw, not one repeated
    other_seed = SamplingParams(temperature=1.0, seed=12)
    assert draws != [
        sample(logits, other_seed, make_generator(other_seed, i))[0] for i in range(20)
    ]
