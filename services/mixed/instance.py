"""MixedInstance: serves whole generations from one engine (no disaggregation)."""

from pdserve.config import EngineConfig, StorageConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.errors import PdserveError
from pdserve.instance.runtime import InstanceRuntime
from pdserve.kvcache.hashing import PromptHashes
from pdserve.observability import tracing
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import common_pb2


class MixedInstance:
    """Threads: the server's executor builds and queues requests, its event loop reads their
    OutputStreams; the runtime's engine thread generates.
    """

    ROLE = "mixed"

    def __init__(self, runtime: InstanceRuntime) -> None:
        self.runtime = runtime

    @classmethod
    def create(
        cls,
        engine_config: EngineConfig,
        storage: StorageConfig | None = None,
        *,
        secret: str,
        tls: TlsFiles | None = None,
    ) -> "MixedInstance":
        """A mixed instance on a runtime of its own (an engine for `engine_config`)."""
        return cls(
            InstanceRuntime.create("mixed", engine_config, secret=secret, tls=tls, storage=storage)
        )

    def start(self) -> None:
        self.runtime.start()

    def stop(self) -> None:
        self.runtime.stop()

    def on_tick(self, engine: LLMEngine) -> None:
        pass

    def reserved(self) -> tuple[int, int]:
        return 0, 0

    def leave(self, error: PdserveError) -> None:
        self.runtime.end_requests(error)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hashes: PromptHashes | None = None,
        attempt: str = "",
        subscriber: str = "",
        trace_parent: tracing.Context | None = None,
    ) -> None:
        """Build the request and queue it; its outputs go to the router's `subscriber`
        subscription, tagged with its `attempt`, traced under `trace_parent` (the router's
        attempt). Raises InvalidRequestError /
        PromptTooLongError, DuplicateRequestError, InstanceUnavailableError (the subscription
        is not open). Blocking: one engine-thread round trip."""
        self.runtime.submit_generation(
            request_id, prompt_token_ids, params, hashes, attempt, subscriber, trace_parent
        )

    def abort(self, request_id: str) -> bool:
        return self.runtime.abort(request_id)

    def stats(self) -> common_pb2.InstanceStats:
        return self.runtime.stats()

    def check_integrity(self) -> None:
        self.runtime.check_integrity()
