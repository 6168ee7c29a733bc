"""The engine: request state machine, scheduler, sampler and the step loop."""

from pdserve.engine.engine import Completion, LLMEngine
from pdserve.engine.request import Request, RequestOutput, RequestStatus, SamplingParams

__all__ = ["Completion", "LLMEngine", "Request", "RequestOutput", "RequestStatus", "SamplingParams"]
