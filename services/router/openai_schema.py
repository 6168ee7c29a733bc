"""The OpenAI request schema the router accepts, validated at the edge.

Unknown fields are ignored (SDKs send many); fields we do not implement are rejected with a clear
400 rather than silently dropped when they would change the result (`n > 1`, `logprobs`, `echo`,
`best_of`, `suffix`, a batch of prompts).
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.engine.request import SamplingParams
from pdserve.errors import InvalidRequestError

DEFAULT_MAX_TOKENS = 16


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> "OpenAIRequest":
        if self.n != 1:
            raise ValueError("n > 1 is not supported; send one request per completion")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return self

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> "CompletionRequest":
        if self.logprobs is not None or self.echo or (self.best_of or 1) > 1 or self.suffix:
            raise ValueError("logprobs, echo, best_of and suffix are not supported")
        prompt = self.prompt
        if (
            isinstance(prompt, list)
            and prompt
            and not isinstance(prompt[0], int)
            and len(prompt) != 1
        ):
            raise ValueError("a batch of prompts is not supported; send one prompt per request")
        return self

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt[0]
        return prompt  # type: ignore[return-value]

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequestError(
                    f"message content of type {part.get('type')!r} is not supported"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False

    @model_validator(mode="after")
    def _no_logprobs(self) -> "ChatCompletionRequest":
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_completion_tokens or self.max_tokens)

    def chat_messages(self) -> list[dict[str, str]]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]
