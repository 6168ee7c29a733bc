"""MixedInstance: serves whole generations from one engine (no disaggregation)."""

from collections.abc import Iterator

from pdserve.config import EngineConfig, StorageConfig
from pdserve.engine.request import RequestOutput, SamplingParams
from pdserve.instance.runtime import InstanceRuntime
from pdserve.kvcache.hashing import PromptHashes
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import common_pb2


class MixedInstance:
    """Threads: one gRPC handler thread per request reads its OutputStream; the runtime's engine
    thread generates.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        storage: StorageConfig | None = None,
        *,
        secret: str,
        tls: TlsFiles | None = None,
    ) -> None:
        self.runtime = InstanceRuntime.create(
            "mixed", engine_config, secret=secret, tls=tls, storage=storage
        )

    def start(self) -> None:
        self.runtime.start()

    def stop(self) -> None:
        self.runtime.stop()

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hashes: PromptHashes | None = None,
    ) -> Iterator[RequestOutput]:
        """Every output of the request until it finishes; closing the iterator early aborts it.
        Raises InvalidRequestError / PromptTooLongError before the first output, and the error
        of a failed engine step (StepFailedError)."""
        request = self.runtime.make_request(
            prompt_token_ids, params, request_id, block_hashes=hashes
        )
        stream = self.runtime.open_stream(request_id)
        finished = False
        try:
            self.runtime.loop.call(lambda engine: engine.submit(request))
            for output in stream:
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.runtime.abort(request_id)
            self.runtime.close_stream(request_id, stream=stream)

    def abort(self, request_id: str) -> bool:
        return self.runtime.abort(request_id)

    def stats(self) -> common_pb2.InstanceStats:
        return self.runtime.stats()

    def check_integrity(self) -> None:
        self.runtime.check_integrity()
