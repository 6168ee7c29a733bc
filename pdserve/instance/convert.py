"""Proto <-> dataclass conversion for the instance services: the one place where pdserve's typed
objects meet generated messages (errors: `pdserve.rpc.status`)."""

import dataclasses
from collections.abc import Sequence

from pdserve.engine.request import SamplingParams, StageTimes, TokenLogprob
from pdserve.errors import PdserveError
from pdserve.instance.streams import Item, OutputStream
from pdserve.kvcache.events import LoadReport
from pdserve.kvcache.hashing import BlockHash, PromptHashes
from pdserve.rpc.status import error_reply
from pdserve.transfer.base import KVEndpoints
from pdserve.v1 import common_pb2, decode_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES = {code: name for name, code in FINISH_REASONS.items()}


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        output_offset=params.output_offset,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
    )
    if params.top_k is not None:
        message.top_k = params.top_k
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    if params.structured is not None:
        message.grammar_kind, message.grammar_spec = params.structured
    if params.seed is not None:
        message.seed = params.seed
    return message


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError for out-of-range values."""
    return SamplingParams(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_k=message.top_k if message.HasField("top_k") else None,
        top_p=message.top_p or 1.0,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        output_offset=message.output_offset,
        min_tokens=message.min_tokens,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        min_p=message.min_p,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
        structured=(message.grammar_kind, message.grammar_spec) if message.grammar_kind else None,
    )


def generate_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    hashes: PromptHashes | None = None,
    attempt: str = "",
    subscriber: str = "",
    route_seq: int = 0,
) -> common_pb2.GenerateRequest:
    message = common_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling_to_proto(params),
        attempt=attempt,
        subscriber=subscriber,
        route_seq=route_seq,
    )
    if hashes is not None:
        message.hash_root = hashes.root
        message.hash_block_size = hashes.block_size
        message.block_hashes.extend(hashes.hashes)
    return message


def hashes_from_proto(message: common_pb2.GenerateRequest) -> PromptHashes | None:
    """The block hash chain a request came with; None when it came without."""
    if not message.hash_root:
        return None
    chain = tuple(BlockHash(h) for h in message.block_hashes)
    return PromptHashes(BlockHash(message.hash_root), message.hash_block_size, chain)


def step_outputs(batch: Sequence[tuple[OutputStream, Item]]) -> common_pb2.StepOutputs:
    """A batch of requests' outputs (or errors) as one message, each built in place in it."""
    step = common_pb2.StepOutputs()
    add = step.outputs.add
    for stream, item in batch:
        message = add(request_id=stream.request_id, attempt=stream.attempt)
        if isinstance(item, PdserveError):
            message.error.CopyFrom(error_reply(item))
            continue
        chunk = message.chunk
        chunk.SetInParent()  # present even when empty (a final output without new text)
        chunk.token_ids.extend(item.new_token_ids)
        chunk.text = item.new_text
        if item.new_logprobs:
            chunk.logprobs.extend(logprob_to_proto(lp) for lp in item.new_logprobs)
        if item.prompt_logprobs:
            chunk.prompt_logprobs.extend(logprob_to_proto(lp) for lp in item.prompt_logprobs)
        if item.finished:
            final = message.final
            final.finish_reason = FINISH_REASONS.get(
                item.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED
            )
            final.stop_reason = "" if item.stop_reason is None else str(item.stop_reason)
            final.num_prompt_tokens = item.num_prompt_tokens
            final.num_output_tokens = item.num_output_tokens
            final.num_cached_tokens = item.num_cached_tokens
            if item.stage_times is not None:
                _timings_to_proto(item.stage_times, final.timings)
    return step


def _timings_to_proto(times: StageTimes, message: common_pb2.StageTimings) -> None:
    message.wait_s = times.wait_s
    message.prefill_s = times.prefill_s
    message.admission_s = times.admission_s
    message.first_step_s = times.first_step_s
    message.device_hit_tokens = times.device_hit_tokens
    message.storage_hit_tokens = times.storage_hit_tokens


def load_to_proto(report: LoadReport) -> common_pb2.InstanceLoad:
    return common_pb2.InstanceLoad(**dataclasses.asdict(report))


def load_from_proto(message: common_pb2.InstanceLoad) -> LoadReport:
    values = {f.name: getattr(message, f.name) for f in dataclasses.fields(LoadReport)}
    return LoadReport(**{**values, "received": dict(message.received)})


def endpoints_to_proto(endpoints: KVEndpoints) -> decode_pb2.KVEndpoints:
    return decode_pb2.KVEndpoints(
        host_id=endpoints.host_id,
        shm_name=endpoints.shm_name,
        mooncake_session=endpoints.mooncake_session,
        mooncake_base=endpoints.mooncake_base,
        kv_bytes=endpoints.kv_bytes,
        cuda_ipc_handle=endpoints.cuda_ipc_handle,
        gpu_uuid=endpoints.gpu_uuid,
        ranks=[endpoints_to_proto(rank) for rank in endpoints.ranks],
    )


def endpoints_from_proto(message: decode_pb2.KVEndpoints) -> KVEndpoints:
    return KVEndpoints(
        message.host_id,
        message.shm_name,
        message.mooncake_session,
        message.mooncake_base,
        message.kv_bytes,
        message.cuda_ipc_handle,
        message.gpu_uuid,
        tuple(endpoints_from_proto(rank) for rank in message.ranks),
    )


def logprob_to_proto(logprob: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        top_ids=[t for t, _ in logprob.top],
        top_logprobs=[v for _, v in logprob.top],
    )


def logprob_from_proto(message: common_pb2.TokenLogprob) -> TokenLogprob:
    top = tuple(zip(message.top_ids, message.top_logprobs, strict=True))
    return TokenLogprob(message.token_id, message.logprob, top)
