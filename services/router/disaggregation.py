"""Conditional disaggregation: compute a prompt on a prefill instance and move its KV, or on
an idle decode instance itself when that is predicted to give the first token sooner.

The prediction uses what each instance reports in `GetStats`: its step time model's
coefficients (`pdserve.engine.perf_model`: a constant per step, per prefill token, per 1k
token pairs of prefill attention, per decode row, per 1k KV tokens the decode rows attend), its
step token budget, its running requests and the KV they hold, its block bytes; and what the
router knows: the prompt's cached tokens on each side (the KV-event index) and the prefill
tokens it has in flight on the prefill instance (its leases).

    remote = queue on prefill + the prompt's uncached chunks there
             + the blocks decode lacks ÷ the measured transfer speed
             (the first token is prefill's, streamed by decode at the handoff)
    local  = the decode step running now (when decode is busy) + the prompt's uncached
             chunks on decode, each step also carrying decode's running batch (rows and the KV
             they attend)
    delay  = decode's running requests × the prompt's own share of those steps (its tokens
             and their attention): the wait computing it there would add to each of them

The prompt is computed on decode when local < remote and nothing decodes there (delay 0: no
request in its polled stats, none the router has sent there since): disaggregation exists to
keep prompts out of the decode steps, and a prompt computed beside a running batch lengthens
every one of its token gaps (weighing that delay against the TTFT saved, local + delay <
remote, still cost ITL p90 1.21x on two cores). `delay` is predicted and reported with the
decision.

A chunk of `new` tokens after `cached` ones costs c0 + c1·new + c2·new·(cached + new/2)/1000
(+ c3·rows + c4·context/1000 on a step shared with decoding requests). `always` and `never`
skip the prediction; `auto` falls back to `always` while either model is unfitted.
"""

import math
from dataclasses import dataclass

from pdserve.v1 import common_pb2

GB = 1e9


@dataclass(frozen=True, slots=True)
class PathChoice:
    local: bool  # compute the prompt on the decode instance
    remote_s: float  # predicted time to first token through prefill (nan: not predicted)
    local_s: float  # predicted time to first token on decode (nan: not predicted)
    # predicted delay computing it on decode adds to each request decoding there, times
    # their number (nan: not predicted)
    delay_s: float = float("nan")


NOT_PREDICTED = float("nan")


def prompt_seconds(
    fit: common_pb2.StepTimeFit,
    budget: int,
    tokens: int,
    cached: int = 0,
    rows: int = 0,
    context: int = 0,
) -> float:
    """Seconds of the steps that compute `tokens` prompt tokens after `cached` ones, in chunks
    of `budget`, each step also carrying `rows` decoding requests that attend `context` KV
    tokens."""
    return _steps_seconds(fit, budget, tokens, rows, context) + prompt_work_seconds(
        fit, budget, tokens, cached
    )


def _steps_seconds(
    fit: common_pb2.StepTimeFit, budget: int, tokens: int, rows: int, context: int
) -> float:
    """What the steps computing `tokens` prompt tokens cost besides the prompt's own work:
    each step's constant and the `rows` decoding requests (attending `context`) it carries."""
    c = fit.coefficients
    per_step = c["constant"] + c["decode_rows"] * rows + c["decode_context"] * context / 1000
    return float(-(-tokens // max(1, budget)) * per_step)


def prompt_work_seconds(
    fit: common_pb2.StepTimeFit, budget: int, tokens: int, cached: int = 0
) -> float:
    """The prompt's own share of those steps (its tokens and their attention): what each
    request decoding beside it waits for."""
    c = fit.coefficients
    seconds, done = 0.0, cached
    for start in range(0, tokens, max(1, budget)):
        new = min(budget, tokens - start)
        attention = new * (done + new / 2) / 1000
        seconds += c["prefill_tokens"] * new + c["prefill_attention"] * attention
        done += new
    return float(seconds)


def decode_step_seconds(fit: common_pb2.StepTimeFit, rows: int, context: int) -> float:
    """Seconds of a step of `rows` decoding requests attending `context` KV tokens."""
    c = fit.coefficients
    return float(c["constant"] + c["decode_rows"] * rows + c["decode_context"] * context / 1000)


def transfer_bytes_per_s(stats: common_pb2.InstanceStats, default: float) -> float:
    """The prefill instance's measured KV transfer speed (all transports), else `default`."""
    seconds = sum(stats.kv_transfer_seconds_by_transport.values())
    sent = sum(stats.kv_bytes_sent_by_transport.values())
    return sent / seconds if seconds > 0 and sent > 0 else default


class Disaggregation:
    """`router.disaggregation` (always | never | auto). Pure: safe from any thread."""

    def __init__(self, mode: str, kv_transfer_gbps: float, block_size: int) -> None:
        self.mode = mode
        self.default_bytes_per_s = kv_transfer_gbps * GB
        self.block_size = block_size

    @property
    def follows_decode(self) -> bool:
        """Whether decode instances' cached prefixes matter (their KV events are followed)."""
        return self.mode != "always"

    def choose(
        self,
        prompt_tokens: int,
        prefill: common_pb2.InstanceStats | None,
        prefill_cached: int,
        prefill_queued: int,
        decode: common_pb2.InstanceStats | None,
        decode_cached: int,
        decode_in_flight: int = 0,
    ) -> PathChoice:
        """Where to compute a prompt of `prompt_tokens` (`*_cached`: tokens each side holds;
        `prefill_queued`: prefill tokens in flight on the prefill instance; `decode_in_flight`:
        the router's requests on the decode instance, which its polled stats may not show
        yet)."""
        if self.mode != "auto":
            return PathChoice(self.mode == "never", NOT_PREDICTED, NOT_PREDICTED)
        if prefill is None or decode is None or not _fitted(prefill) or not _fitted(decode):
            return PathChoice(False, NOT_PREDICTED, NOT_PREDICTED)
        budget, uncached = decode.max_num_batched_tokens, prompt_tokens - decode_cached
        remote = self._remote_seconds(prompt_tokens, prefill, prefill_cached, prefill_queued)
        remote += self._transfer_seconds(prompt_tokens, prefill, decode, decode_cached)
        # the first token is prefill's, streamed by decode at the handoff: no decode step
        # waits for it; on decode, a prompt first waits for the step running there
        rows, held = max(decode.num_running, decode_in_flight), _held_tokens(decode)
        running = decode_step_seconds(decode.step_time, rows, held) if rows else 0.0
        # every request decoding there would wait for the prompt's share of each step it rides
        work = prompt_work_seconds(decode.step_time, budget, uncached, decode_cached)
        local = running + _steps_seconds(decode.step_time, budget, uncached, rows, held) + work
        return PathChoice(rows == 0 and local < remote, remote, local, rows * work)

    def _remote_seconds(
        self, prompt_tokens: int, prefill: common_pb2.InstanceStats, cached: int, queued: int
    ) -> float:
        budget = prefill.max_num_batched_tokens
        queue = prompt_seconds(prefill.step_time, budget, queued)
        return queue + prompt_seconds(prefill.step_time, budget, prompt_tokens - cached, cached)

    def _transfer_seconds(
        self,
        prompt_tokens: int,
        prefill: common_pb2.InstanceStats,
        decode: common_pb2.InstanceStats,
        decode_cached: int,
    ) -> float:
        blocks = math.ceil(prompt_tokens / self.block_size) - decode_cached // self.block_size
        speed = transfer_bytes_per_s(prefill, self.default_bytes_per_s)
        return max(0, blocks) * decode.kv_block_bytes / speed


def _fitted(stats: common_pb2.InstanceStats) -> bool:
    fit = stats.step_time
    return fit.samples > 0 and any(fit.coefficients.values()) and stats.max_num_batched_tokens > 0


def _held_tokens(stats: common_pb2.InstanceStats) -> int:
    """The KV tokens the instance's requests hold (blocks in use × block size)."""
    return (stats.num_blocks - stats.num_free_blocks) * stats.block_size
