"""The engine's step time as a function of what the step holds, fitted online from its own steps.

A step's time is modelled as linear in five features of its batch (`StepShape`):

    seconds ≈ c0 + c1·prefill_tokens + c2·prefill_attention + c3·decode_rows + c4·decode_context

`prefill_tokens`: the prompt tokens the step computes (the projections and MLPs scale with them);
`prefill_attention`: their attention work, Σ new·(cached + new/2) over prefill chunks, in
thousands of token pairs (a chunk after a long cached prefix reads it all); `decode_rows`: the
sequences that add one token (per-row sampling and bookkeeping, the weight reads a small batch
is bound by); `decode_context`: the KV tokens those rows attend, in thousands. `c0` is the
step's fixed cost (scheduling, the launch of every layer). `benchmarks/perf_model.py` reports
the residuals of this model and of the models without each attention feature.

The fit is least squares over every observed step with exponential forgetting (recent steps
weigh more: a machine's speed drifts), solved on the normal equations (5 × 5) every few
steps, coefficients kept non-negative (a feature that would get a negative weight is dropped
from that solve). Each step's prediction, made before its time is known, is scored: the
relative errors feed a histogram (Prometheus) and the recent median, and the recent ratios of
measured to predicted time give quantiles (`ratio_quantiles`, exported in `GetStats`) that the
latency simulator draws step times from. Engine thread only.
"""

import bisect
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FEATURES = ("constant", "prefill_tokens", "prefill_attention", "decode_rows", "decode_context")
# relative error |predicted - measured| / measured
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
DECAY = 0.998  # per observed step: a step's weight halves after ~350 more
REFIT_EVERY = 16  # steps between solves
MIN_STEPS = 8  # steps before the first fit (and before predictions are scored)
RECENT = 512  # relative errors (and measured ÷ predicted ratios) kept
QUANTILES = 20  # ratio quantiles exported


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step holds (see the module's docstring)."""

    prefill_tokens: int = 0
    prefill_attention: float = 0.0  # thousands of token pairs
    decode_rows: int = 0
    decode_context: float = 0.0  # thousands of tokens

    def features(self) -> tuple[float, ...]:
        return (1.0, self.prefill_tokens, self.prefill_attention, self.decode_rows,
                self.decode_context)  # fmt: skip


def step_shape(chunks: Iterable[tuple[int, int]]) -> StepShape:
    """The shape of a step of (cached tokens, new tokens) chunks: one new token is a decode
    row, more are a prefill chunk."""
    prefill_tokens, prefill_pairs, decode_rows, decode_context = 0, 0.0, 0, 0
    for cached, new in chunks:
        if new == 1:
            decode_rows += 1
            decode_context += cached + 1
        else:
            prefill_tokens += new
            prefill_pairs += new * (cached + new / 2)
    return StepShape(prefill_tokens, prefill_pairs / 1000, decode_rows, decode_context / 1000)


def midpoint_quantiles(values: Iterable[float], count: int) -> list[float]:
    """`values` at the midpoints of `count` equal shares, ascending (empty when there are fewer
    than `count`): a summary to draw from that keeps the spread and its skew."""
    ordered = sorted(values)
    if len(ordered) < count:
        return []
    return [ordered[int((k + 0.5) * len(ordered) / count)] for k in range(count)]


class StepTimeModel:
    def __init__(self) -> None:
        n = len(FEATURES)
        self._gram = np.zeros((n, n))  # Σ w·x·xᵀ
        self._moment = np.zeros(n)  # Σ w·x·seconds
        self.coefficients = np.zeros(n)
        self.samples = 0  # steps observed (profiling included)
        self._since_fit = 0
        self.error_counts = [0] * (len(ERROR_BUCKETS) + 1)  # the last: above every bound
        self.error_sum = 0.0
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._ratios: deque[float] = deque(maxlen=RECENT)  # measured ÷ predicted

    @classmethod
    def fixed(cls, coefficients: Mapping[str, float]) -> "StepTimeModel":
        """A model that predicts with `coefficients` (by feature name: a fit an instance
        exported) until it observes steps of its own."""
        model = cls()
        model.coefficients = np.array([float(coefficients[name]) for name in FEATURES])
        model.samples = MIN_STEPS
        return model

    @property
    def fitted(self) -> bool:
        return self.samples >= MIN_STEPS

    def predict(self, shape: StepShape) -> float:
        """Seconds the step should take (0 before the first fit)."""
        return float(np.dot(self.coefficients, shape.features()))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step took `seconds`: score the prediction, then learn from it."""
        if self.fitted and seconds > 0:
            predicted = self.predict(shape)
            self._score(abs(predicted - seconds) / seconds)
            if predicted > 0:
                self._ratios.append(seconds / predicted)
        x = np.asarray(shape.features())
        self._gram *= DECAY
        self._moment *= DECAY
        self._gram += np.outer(x, x)
        self._moment += x * seconds
        self.samples += 1
        self._since_fit += 1
        if self.samples == MIN_STEPS or (self.fitted and self._since_fit >= REFIT_EVERY):
            self.refit()

    def refit(self) -> None:
        """Solve for the coefficients now (non-negative least squares on the normal
        equations, each column scaled to unit weight)."""
        self._since_fit = 0
        scale = np.sqrt(np.diag(self._gram))
        active = [i for i in range(len(FEATURES)) if scale[i] > 0]
        while active:
            idx = np.asarray(active)
            gram = self._gram[np.ix_(idx, idx)] / np.outer(scale[idx], scale[idx])
            moment = self._moment[idx] / scale[idx]
            ridge = 1e-9 * np.eye(len(idx))
            solution = np.linalg.solve(gram + ridge, moment) / scale[idx]
            if (solution >= 0).all():
                self.coefficients = np.zeros(len(FEATURES))
                self.coefficients[idx] = solution
                return
            active = [i for i, c in zip(active, solution, strict=True) if c > 0]
        self.coefficients = np.zeros(len(FEATURES))

    def _score(self, error: float) -> None:
        self.error_counts[bisect.bisect_left(ERROR_BUCKETS, error)] += 1
        self.error_sum += error
        self._recent.append(error)

    def median_error(self) -> float:
        """The median relative error of the recent scored predictions (nan: none yet)."""
        return statistics.median(self._recent) if self._recent else float("nan")

    def ratio_quantiles(self) -> list[float]:
        """Measured ÷ predicted step time of the recent scored steps at the midpoints of
        QUANTILES equal shares, ascending (empty while fewer were scored): how far and which
        way steps stray from the fit on this machine under this load."""
        return midpoint_quantiles(self._ratios, QUANTILES)

    def named_coefficients(self) -> dict[str, float]:
        """Seconds per unit of each feature (`constant`: per step)."""
        return {name: float(c) for name, c in zip(FEATURES, self.coefficients, strict=True)}

    # -- persistence: a fit seeds the next start of the same model and settings ----------------

    def state(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "gram": self._gram.tolist(),
                "moment": self._moment.tolist(), "samples": self.samples}  # fmt: skip

    def load(self, state: Mapping[str, Any]) -> bool:
        """Take a saved fit (`state`); False (nothing changed) when it is not one of these
        features."""
        gram, moment = np.asarray(state.get("gram", ())), np.asarray(state.get("moment", ()))
        n = len(FEATURES)
        if list(state.get("features", ())) != list(FEATURES) or gram.shape != (n, n):
            return False
        if moment.shape != (n,) or not np.isfinite(gram).all() or not np.isfinite(moment).all():
            return False
        self._gram, self._moment = gram, moment
        self.samples = max(int(state.get("samples", 0)), MIN_STEPS)
        self.refit()
        return True
