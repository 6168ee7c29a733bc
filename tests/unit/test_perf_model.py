"""The step time model: a step's shape, the online fit, its scoring and its saved state."""

import random

import pytest

from pdserve.engine.perf_model import (
    ERROR_BUCKETS,
    FEATURES,
    MIN_STEPS,
    QUANTILES,
    RECENT,
    StepShape,
    StepTimeModel,
    step_shape,
)

TRUE = {"constant": 0.004, "prefill_tokens": 5e-5, "prefill_attention": 2e-5,
        "decode_rows": 1e-4, "decode_context": 3e-4}  # fmt: skip


def seconds(shape: StepShape, coefficients: dict[str, float] = TRUE) -> float:
    return sum(c * x for c, x in zip(coefficients.values(), shape.features(), strict=True))


def random_shapes(count: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    chunks = [
        [(rng.randrange(0, 2000), 1) for _ in range(rng.randrange(0, 64))]
        + [(rng.randrange(0, 512), rng.randrange(2, 512)) for _ in range(rng.randrange(0, 3))]
        for _ in range(count)
    ]
    return [step_shape(c) for c in chunks if c]


def test_a_step_shape_counts_prefill_chunks_and_decode_rows() -> None:
    shape = step_shape([(100, 1), (31, 1), (0, 64), (64, 32)])
    assert shape.decode_rows == 2 and shape.decode_context == pytest.approx((101 + 32) / 1000)
    assert shape.prefill_tokens == 96
    assert shape.prefill_attention == pytest.approx((64 * 32 + 32 * (64 + 16)) / 1000)
    assert shape.features()[0] == 1.0


def test_the_fit_recovers_a_linear_step_time() -> None:
    model = StepTimeModel()
    for shape in random_shapes(400):
        model.observe(shape, seconds(shape))
    model.refit()
    for name, value in model.named_coefficients().items():
        assert value == pytest.approx(TRUE[name], rel=1e-3), name
    assert model.median_error() < 1e-3  # every prediction after the first fit was right


def test_noise_is_averaged_and_scored() -> None:
    rng = random.Random(1)
    model = StepTimeModel()
    for shape in random_shapes(2000, seed=2):
        model.observe(shape, seconds(shape) * rng.uniform(0.9, 1.1))
    assert 0.02 < model.median_error() < 0.06  # ±10 % uniform noise: median |error| ~5 %
    assert sum(model.error_counts) == model.samples - MIN_STEPS
    assert len(model.error_counts) == len(ERROR_BUCKETS) + 1


def test_the_ratio_quantiles_give_the_spread_of_recent_steps() -> None:
    """Steps on a busy machine: a quarter take twice their usual time. The ratios of measured
    to predicted time say so, whatever the fit settles on (the simulator draws from them);
    there are none before QUANTILES steps were scored."""
    model = StepTimeModel()
    shapes = random_shapes(RECENT + 400, seed=3)
    for n, shape in enumerate(shapes):
        if n == MIN_STEPS + QUANTILES - 1:  # the steps from MIN_STEPS on were scored
            assert model.ratio_quantiles() == []  # one short
        if n == MIN_STEPS + QUANTILES:
            assert len(model.ratio_quantiles()) == QUANTILES
        model.observe(shape, seconds(shape) * (2.0 if n % 4 == 0 else 1.0))
    quantiles = model.ratio_quantiles()
    assert len(quantiles) == QUANTILES and quantiles == sorted(quantiles)
    slow = [q for q in quantiles if q > 1.5 * quantiles[0]]
    assert len(slow) == QUANTILES // 4
    assert min(slow) / quantiles[0] == pytest.approx(2.0, rel=0.1)


def test_no_coefficient_goes_negative() -> None:
    """Data that a negative per-row cost would fit better: the feature is dropped instead."""
    model = StepTimeModel()
    for shape in random_shapes(300, seed=3):
        model.observe(shape, 0.01 - 1e-6 * shape.decode_rows + 1e-4 * shape.prefill_tokens)
    model.refit()
    coefficients = model.named_coefficients()
    assert all(value >= 0 for value in coefficients.values())
    assert coefficients["prefill_tokens"] == pytest.approx(1e-4, rel=0.05)


def test_recent_steps_outweigh_old_ones() -> None:
    """The machine got twice as slow: 1,500 steps later the old ones weigh 5 %."""
    model = StepTimeModel()
    shapes = random_shapes(3000, seed=4)
    for shape in shapes[:1500]:
        model.observe(shape, seconds(shape))
    slower = {name: 2 * value for name, value in TRUE.items()}
    for shape in shapes[1500:]:
        model.observe(shape, seconds(shape, slower))
    model.refit()
    fitted = model.named_coefficients()
    assert fitted["constant"] == pytest.approx(slower["constant"], rel=0.1)
    assert fitted["decode_context"] == pytest.approx(slower["decode_context"], rel=0.1)


def test_a_saved_fit_seeds_a_new_model_and_a_foreign_one_is_refused() -> None:
    model = StepTimeModel()
    for shape in random_shapes(100, seed=5):
        model.observe(shape, seconds(shape))
    state = model.state()
    seeded = StepTimeModel()
    assert seeded.load(state) and seeded.fitted
    shape = random_shapes(1, seed=6)[0]
    assert seeded.predict(shape) == pytest.approx(seconds(shape), rel=1e-3)
    assert not StepTimeModel().load({**state, "features": ["constant"]})
    assert not StepTimeModel().load({**state, "gram": [[1.0]]})
    assert not StepTimeModel().load({})
    assert list(state["features"]) == list(FEATURES)
