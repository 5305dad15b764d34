"""Attention-time predictors: the constant one and the least-squares fit on profiled samples."""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    AttentionProfileSample,
    ConstantAttentionTimePredictor,
    FittedAttentionTimePredictor,
)

TRUE_MODEL = FittedAttentionTimePredictor(
    seconds_per_attended_pair=3e-10,
    seconds_per_new_token=2e-7,
    seconds_per_chunk=5e-5,
    seconds_per_batch=1e-4,
)


def _samples(model, batches):
    return [AttentionProfileSample(tuple(chunks), model.predict_s(chunks)) for chunks in batches]


def test_fit_recovers_the_model_from_noise_free_samples():
    batches = [
        [(0, 512)],
        [(4096, 256), (0, 1024)],
        [(16384, 429), (32768, 429), (1000, 64)],
        [(65536, 2048)],
        [(128, 16)] * 8,
        [(8192, 4096), (0, 8)],
    ]
    fitted = FittedAttentionTimePredictor.fit(_samples(TRUE_MODEL, batches))
    for name in (
        "seconds_per_attended_pair",
        "seconds_per_new_token",
        "seconds_per_chunk",
        "seconds_per_batch",
    ):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE_MODEL, name), rel=1e-6)


def test_fit_with_one_chunk_per_sample_still_predicts():
    # The chunk count equals the constant in every sample: the two cannot be told apart, and
    # the fit keeps one of them.
    batches = [[(cached, new)] for cached in (0, 1000, 30000) for new in (16, 400, 3000)]
    fitted = FittedAttentionTimePredictor.fit(_samples(TRUE_MODEL, batches))
    for chunks in ([(5000, 100)], [(20000, 2000)]):
        assert fitted.predict_s(chunks) == pytest.approx(TRUE_MODEL.predict_s(chunks), rel=1e-6)


def test_fit_keeps_every_coefficient_non_negative():
    # Time that shrinks with work cannot be modelled monotonically: the fit flattens it.
    samples = [
        AttentionProfileSample(((0, 100),), 0.010),
        AttentionProfileSample(((0, 200),), 0.008),
        AttentionProfileSample(((0, 400),), 0.006),
    ]
    fitted = FittedAttentionTimePredictor.fit(samples)
    assert (
        min(
            fitted.seconds_per_attended_pair,
            fitted.seconds_per_new_token,
            fitted.seconds_per_chunk,
            fitted.seconds_per_batch,
        )
        >= 0
    )
    assert fitted.predict_s([(0, 200)]) == pytest.approx(0.008)


def test_fit_needs_samples():
    with pytest.raises(ValueError, match="at least one profile sample"):
        FittedAttentionTimePredictor.fit([])


def test_empty_batches_take_no_time():
    assert TRUE_MODEL.predict_s([]) == 0.0
    assert ConstantAttentionTimePredictor(1.0, 5.0).predict_s([]) == 0.0


def test_constant_predictor():
    predictor = ConstantAttentionTimePredictor(seconds_per_new_token=0.5, seconds_per_batch=2.0)
    assert predictor.predict_s([(1000, 2), (0, 4)]) == 5.0
