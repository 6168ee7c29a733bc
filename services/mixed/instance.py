"""MixedInstance: serves whole generations from one engine (no disaggregation)."""

from pdserve.config import EngineConfig, StorageConfig
from pdserve.engine.request import SamplingParams
from pdserve.instance.runtime import InstanceRuntime
from pdserve.instance.streams import OutputStream
from pdserve.kvcache.hashing import PromptHashes
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import common_pb2


class MixedInstance:
    """Threads: the server's executor builds and queues requests, its event loop reads their
    OutputStreams; the runtime's engine thread generates.
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

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hashes: PromptHashes | None = None,
    ) -> None:
        """Build the request and queue it; its outputs go to the stream opened for it
        (`runtime.open_stream`). Raises InvalidRequestError / PromptTooLongError. Blocking:
        one engine-thread round trip."""
        request = self.runtime.make_request(
            prompt_token_ids, params, request_id, block_hashes=hashes
        )
        self.runtime.loop.call(lambda engine: engine.submit(request))

    def end(self, request_id: str, stream: OutputStream, finished: bool) -> None:
        """The reader is done with the request's stream: abort the request unless it finished,
        and unregister the stream. Blocking."""
        if not finished:
            self.runtime.abort(request_id)
        self.runtime.close_stream(request_id, stream=stream)

    def abort(self, request_id: str) -> bool:
        return self.runtime.abort(request_id)

    def stats(self) -> common_pb2.InstanceStats:
        return self.runtime.stats()

    def check_integrity(self) -> None:
        self.runtime.check_integrity()
