"""MixedInstance: serves whole generations from one engine (no disaggregation)."""

import queue
from collections.abc import Iterator

from pdserve.config import EngineConfig, StorageConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.request import SamplingParams
from pdserve.rpc.instance import InstanceCore
from pdserve.v1 import common_pb2


class MixedInstance:
    def __init__(self, engine_config: EngineConfig, storage: StorageConfig | None = None) -> None:
        self.core = InstanceCore.create(
            "mixed", engine_config, on_tick=lambda: None, storage=storage
        )

    def start(self) -> None:
        self.core.start()

    def stop(self) -> None:
        self.core.stop()

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Iterator[RequestOutput]:
        """Every output of the request until it finishes; closing the iterator early aborts it.
        Raises InvalidRequestError / PromptTooLongError before the first output."""
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

        def add(engine: LLMEngine) -> None:
            request = engine.make_request(prompt_token_ids, params, request_id)
            self.core.set_sink(request_id, outputs.put)
            engine.submit(request)

        self.core.loop.call(add)
        finished = False
        try:
            while not finished:
                output = outputs.get()
                finished = output.finished
                yield output
        finally:
            self.core.drop_sink(request_id)
            if not finished:
                self.core.abort(request_id)

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def stats(self) -> common_pb2.InstanceStats:
        return self.core.stats()

    def check_integrity(self) -> None:
        self.core.check_integrity()
