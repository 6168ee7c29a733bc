"""Prefill/decode disaggregation over real gRPC servers (in-process instances on port 0).

Each test tears down with `check_integrity()` on both instances and checks that nothing leaks:
every block free or cached, no reservation left.
"""

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from credentials import SECRET, channels
from waiting import wait_for

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, TransferConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import KVTransferError, ResourceExhaustedError
from pdserve.instance.convert import generate_request
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode
from services.prefill.instance import PrefillInstance
from services.prefill.servicer import serve_prefill
from services.router.pd_client import Finished, PDClient, TokenDelta


@dataclass
class PDPair:
    prefill: PrefillInstance
    decode: DecodeInstance
    prefill_address: str
    decode_address: str
    servers: list[grpc.Server] = field(default_factory=list)
    client: PDClient = field(default_factory=lambda: PDClient(channels()))

    def generate(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], Finished]:
        tokens: list[int] = []
        for event in self.client.generate(
            self.prefill_address, self.decode_address, prompt, params
        ):
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
            else:
                return tokens, event
        raise AssertionError("stream ended without a final event")

    def decode_stub(self) -> decode_pb2_grpc.DecodeServiceStub:
        return decode_pb2_grpc.DecodeServiceStub(self.client.channels.get(self.decode_address))


@pytest.fixture
def make_pair(tiny_model_dir: Path) -> Iterator[Callable[..., PDPair]]:
    pairs: list[PDPair] = []

    def make(
        num_kv_blocks: int = 256,
        decode: DecodeConfig | None = None,
        transfer: TransferConfig | None = None,
        **prefill: object,
    ) -> PDPair:
        engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=num_kv_blocks)
        p, p_server, p_port = serve_prefill(
            engine,
            PrefillConfig(**prefill),  # type: ignore[arg-type]
            transfer=transfer,
            secret=SECRET,
        )
        d, d_server, d_port = serve_decode(
            engine, decode or DecodeConfig(), transfer=transfer, secret=SECRET
        )
        pair = PDPair(p, d, f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}", [p_server, d_server])
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        wait_for(lambda pair=pair: pair.decode.stats().num_running == 0)
        for instance in (pair.prefill, pair.decode):
            instance.check_integrity()
            stats = instance.stats()
            assert stats.num_free_blocks == stats.num_blocks, f"{stats.role} leaked blocks"
            assert stats.num_reservations == 0
        pair.client.close()
        for server in pair.servers:
            server.stop(0)
        pair.prefill.stop()
        pair.decode.stop()


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(3 * i + 5 * offset + 1) % 250 for i in range(n)]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_pd_output_equals_mixed_output_for_concurrent_shared_prefixes(
    make_pair: Callable[..., PDPair], make_engine: Callable[..., LLMEngine]
) -> None:
    system = prompt(40)
    prompts = [system + prompt(n, offset=n) for n in (1, 9, 30, 47)]
    pair = make_pair()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: pair.generate(p, GREEDY), prompts))
    mixed = make_engine().generate(prompts, GREEDY)
    for (tokens, final), expected in zip(results, mixed, strict=True):
        assert tokens == list(expected.token_ids)
        assert final.finish_reason == "length"
        assert final.num_output_tokens == 24


@pytest.mark.parametrize("transport", ["grpc", "shm", "mooncake"])
def test_pd_output_is_identical_over_every_transport(
    transport: str, make_pair: Callable[..., PDPair], make_engine: Callable[..., LLMEngine]
) -> None:
    pair = make_pair(transfer=TransferConfig(transport=transport))
    system = prompt(40)
    prompts = [system + prompt(n, offset=n) for n in (3, 30)]
    results = [pair.generate(p, GREEDY) for p in prompts]
    mixed = make_engine().generate(prompts, GREEDY)
    assert [tokens for tokens, _ in results] == [list(m.token_ids) for m in mixed]
    first, second = (final.prefill for _, final in results)
    assert first.transport == transport and first.kv_blocks_sent == 3  # ceil(43 / 16)
    assert second.kv_blocks_sent == 3  # 5 blocks, of which decode held 2 (the system prompt)
    stats = pair.prefill.stats()
    assert stats.kv_blocks_sent_by_transport[transport] == 6
    assert pair.decode.stats().kv_blocks_received == 6


def test_auto_transport_picks_shared_memory_on_the_same_host(
    make_pair: Callable[..., PDPair],
) -> None:
    pair = make_pair(transfer=TransferConfig())
    _, final = pair.generate(prompt(50), GREEDY)
    assert final.prefill.transport == "shm"


def test_second_request_with_the_same_prefix_moves_fewer_bytes(
    make_pair: Callable[..., PDPair],
) -> None:
    pair = make_pair()
    _, first = pair.generate(prompt(100), GREEDY)
    _, second = pair.generate([*prompt(100), 7, 8, 9], GREEDY)
    assert first.prefill.kv_blocks_sent == 7  # ceil(100 / 16)
    assert second.prefill.num_decode_cached_tokens == 96
    assert second.prefill.num_cached_tokens == 96  # prefill's own device cache hit
    assert second.prefill.kv_blocks_sent == 1
    assert 0 < second.prefill.kv_bytes_sent < first.prefill.kv_bytes_sent
    stats = pair.decode.stats()
    assert stats.kv_bytes_received == first.prefill.kv_bytes_sent + second.prefill.kv_bytes_sent


def test_sampling_with_a_seed_is_identical_in_pd_and_mixed_mode(
    make_pair: Callable[..., PDPair], make_engine: Callable[..., LLMEngine]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    tokens, _ = make_pair().generate(prompt(33), params)
    [mixed] = make_engine().generate([prompt(33)], params)
    assert tokens == list(mixed.token_ids)


def test_stop_string_and_text_stream_from_decode(make_pair: Callable[..., PDPair]) -> None:
    pair = make_pair()
    text = "".join(e.text for e in pair.client.generate(
        pair.prefill_address, pair.decode_address, prompt(20), GREEDY
    ) if isinstance(e, TokenDelta))  # fmt: skip
    stop = text[5:8]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    events = list(
        pair.client.generate(pair.prefill_address, pair.decode_address, prompt(20), params)
    )
    streamed = "".join(e.text for e in events if isinstance(e, TokenDelta))
    final = events[-1]
    assert isinstance(final, Finished)
    assert streamed == text[: text.index(stop)]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)


def test_full_decode_refuses_a_request_that_would_eat_the_reserve(
    make_pair: Callable[..., PDPair],
) -> None:
    # 24 blocks; each running request (40-token prompt, 150 new tokens) may grow to 12 blocks.
    decode = DecodeConfig(reserve_horizon_tokens=None, retry_after_ms=10)
    pair = make_pair(num_kv_blocks=24, decode=decode, reserve_max_attempts=2)
    long_run = SamplingParams(max_tokens=150, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(pair.generate, prompt(40, offset=i), long_run) for i in range(2)]
        wait_for(lambda: pair.decode.stats().num_running == 2)
        with pytest.raises(ResourceExhaustedError, match="refused") as refused:
            pair.generate(prompt(40, offset=9), GREEDY)
        assert refused.value.retry_after_ms == 10
        assert all(len(f.result()[0]) == 150 for f in running)
    tokens, final = pair.generate(prompt(40, offset=9), GREEDY)
    assert len(tokens) == 24 and final.finish_reason == "length"


def test_expired_reservation_frees_its_blocks(make_pair: Callable[..., PDPair]) -> None:
    pair = make_pair(decode=DecodeConfig(reservation_timeout_s=0.2))
    message = decode_pb2.ReserveRequest(request=generate_request("r1", prompt(50), GREEDY))
    reply = pair.decode_stub().Reserve(message)
    assert reply.num_blocks == 4
    assert pair.decode.stats().num_reserved_blocks == 4
    wait_for(lambda: pair.decode.stats().num_expired_reservations == 1)
    stats = pair.decode.stats()
    assert (stats.num_reservations, stats.num_free_blocks) == (0, stats.num_blocks)
    start = decode_pb2.StartDecodeRequest(request_id="r1", first_token_id=5)
    with pytest.raises(grpc.RpcError) as late:
        pair.decode_stub().StartDecode(start)
    assert late.value.code() == grpc.StatusCode.NOT_FOUND


def test_broken_kv_stream_releases_the_reservation_at_once(
    make_pair: Callable[..., PDPair],
) -> None:
    pair = make_pair(decode=DecodeConfig(reservation_timeout_s=600))
    stub = pair.decode_stub()
    reply = stub.Reserve(
        decode_pb2.ReserveRequest(request=generate_request("r2", prompt(50), GREEDY))
    )
    first_sent, hang = threading.Event(), threading.Event()

    def chunks() -> Iterator[decode_pb2.KVChunk]:
        yield decode_pb2.KVChunk(
            request_id="r2", first_block=0, num_blocks=1, data=bytes(reply.block_bytes)
        )
        first_sent.set()
        hang.wait(30)

    call = stub.PushKV.future(chunks())
    try:
        first_sent.wait(10)
        wait_for(lambda: pair.decode.stats().kv_blocks_received == 1)
        call.cancel()  # the stream stays open until now: only the cancellation can end it
        wait_for(lambda: pair.decode.stats().num_reservations == 0)
    finally:
        hang.set()
    assert pair.decode.stats().num_expired_reservations == 0


def test_kv_chunk_outside_the_reservation_is_rejected(make_pair: Callable[..., PDPair]) -> None:
    pair = make_pair()
    stub = pair.decode_stub()
    reply = stub.Reserve(
        decode_pb2.ReserveRequest(request=generate_request("r3", prompt(20), GREEDY))
    )
    bad = decode_pb2.KVChunk(
        request_id="r3", first_block=5, num_blocks=1, data=bytes(reply.block_bytes), last=True
    )
    with pytest.raises(grpc.RpcError) as rejected:
        stub.PushKV(iter([bad]))
    assert rejected.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert pair.decode.stats().num_reservations == 0


def test_invalid_request_is_reported_and_nothing_is_reserved(
    make_pair: Callable[..., PDPair],
) -> None:
    pair = make_pair()
    with pytest.raises(Exception, match="outside the vocabulary"):
        pair.generate([1, 2, 10_000], GREEDY)
    with pytest.raises(grpc.RpcError) as invalid:
        pair.decode_stub().Reserve(
            decode_pb2.ReserveRequest(request=generate_request("x", [], GREEDY))
        )
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_abort_on_decode_ends_the_token_stream(make_pair: Callable[..., PDPair]) -> None:
    pair = make_pair()
    events = pair.client.generate(
        pair.prefill_address,
        pair.decode_address,
        prompt(30),
        SamplingParams(max_tokens=4000, ignore_eos=True),
        request_id="long",
    )
    assert isinstance(next(events), TokenDelta)
    assert pair.client.instance(pair.decode_address).abort("long")
    final = [e for e in events if isinstance(e, Finished)]
    assert final[0].finish_reason == "abort"


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_a_decode_that_disappears_mid_transfer_leaves_nothing_pinned_on_prefill(
    transport: str, tiny_model_dir: Path
) -> None:
    """The decode instance goes away between its reservation and the direct write: the write or
    its commit fails, the request fails with a clear error, and prefill releases every block."""
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256)
    transfer = TransferConfig(transport=transport)
    prefill, p_server, p_port = serve_prefill(
        engine, PrefillConfig(), transfer=transfer, secret=SECRET
    )
    decode, d_server, d_port = serve_decode(
        engine, DecodeConfig(), transfer=transfer, secret=SECRET
    )
    client = PDClient(channels())
    errors: list[Exception] = []

    def run() -> None:
        try:
            list(client.generate(f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}", prompt(900), GREEDY))
        except Exception as e:  # the failure the client must see
            errors.append(e)

    try:
        worker = threading.Thread(target=run)
        worker.start()
        wait_for(lambda: decode.stats().num_reservations == 1)  # prefill now computes the prompt
        d_server.stop(0).wait()
        decode.stop()  # its KV memory is unregistered and its segment removed
        worker.join(timeout=60)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], KVTransferError), errors
        prefill.check_integrity()
        stats = prefill.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
    finally:
        client.close()
        p_server.stop(0).wait()
        prefill.stop()


def test_a_token_stream_opened_before_its_reservation_serves_that_attempt_only(
    make_pair: Callable[..., PDPair],
) -> None:
    """The router opens decode's StreamTokens alongside Prefill: a stream for attempt `a1`
    waits for that reservation and then streams the request; a stream for another attempt
    (an earlier one's leftover) stays unattached, and its cancellation aborts nothing."""
    pair = make_pair()
    expected, _ = pair.generate(prompt(40, offset=3), GREEDY)
    stub = pair.decode_stub()
    early = stub.StreamTokens(
        decode_pb2.StreamTokensRequest(request_id="early", attempt="a1"), timeout=60
    )
    stale = stub.StreamTokens(
        decode_pb2.StreamTokensRequest(request_id="early", attempt="a0"), timeout=60
    )
    waiting = pair.decode.runtime._awaiting
    wait_for(lambda: len(waiting.get("early", ())) == 2)  # both wait on decode: no reservation
    message = prefill_pb2.PrefillRequest(
        request=generate_request("early", prompt(40, offset=3), GREEDY, attempt="a1"),
        decode_address=pair.decode_address,
    )
    prefill = prefill_pb2_grpc.PrefillServiceStub(pair.client.channels.get(pair.prefill_address))
    result = prefill.Prefill(message, timeout=60)
    stale.cancel()
    tokens = [t for reply in early if reply.HasField("chunk") for t in reply.chunk.token_ids]
    assert result.first_token_id == expected[0]
    assert tokens == expected
    with pytest.raises(grpc.RpcError) as cancelled:
        next(stale)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: not waiting)
