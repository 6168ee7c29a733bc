"""The OpenAI request schema the router accepts, validated at the edge.

Every field is either implemented or rejected with a 400 that names it, except the fields of
`IGNORED_FIELDS`, which OpenAI clients send and which change nothing here. Integers are bounded;
strings must be valid Unicode (a lone surrogate is a 400, not a tokenizer crash).
"""

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.engine.request import (
    LOGIT_BIAS,
    LOGPROBS,
    MAX_LOGIT_BIAS_TOKENS,
    MIN_P,
    PENALTY,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOP_P,
    Range,
    SamplingParams,
)
from pdserve.errors import InvalidRequestError
from services.router import tool_calls

DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_LIMIT = 2**31 - 1  # beyond any context window; the context check words the error
MAX_CHOICES = 16  # n and best_of: each choice is a generation (and a router thread)

# Sent by OpenAI SDKs and frameworks; they change nothing about the generation here.
IGNORED_FIELDS = frozenset(
    {"metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
)
# Known OpenAI / vLLM fields this server does not implement (yet): a 400 names them.
UNSUPPORTED_FIELDS = frozenset(
    {
 "tools", "tool_choice", "functions", "function_call", "guided_grammar",
        "structured_outputs", "prediction", "modalities", "audio", "reasoning_effort",
        "web_search_options", "use_beam_search", "length_penalty", "suffix",
    }
)  # fmt: skip


# Values of unsupported fields that ask for nothing (clients send defaults explicitly).
_NEUTRAL: dict[str, Any] = {"use_beam_search": False, "length_penalty": 1}


def _within(allowed: Range) -> Any:
    """A field's range (its `Annotated` metadata), as SamplingParams defines it."""
    if allowed.low_open:
        return Field(gt=allowed.low, le=allowed.high)
    return Field(ge=allowed.low, le=allowed.high)


def _neutral(name: str, value: Any) -> bool:
    return value is None or (name in _NEUTRAL and value == _NEUTRAL[name])


def _check_text(value: str, where: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} is not valid Unicode (a lone surrogate?)") from None
    return value


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Annotated[float, _within(TEMPERATURE)] = 1.0
    top_p: Annotated[float, _within(TOP_P)] = 1.0
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # vLLM: -1 or unset = off
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream_options: dict[str, Any] | None = None
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)  # vLLM
    min_p: Annotated[float, _within(MIN_P)] = 0.0  # vLLM
    presence_penalty: Annotated[float, _within(PENALTY)] = 0.0
    frequency_penalty: Annotated[float, _within(PENALTY)] = 0.0
    repetition_penalty: Annotated[float, _within(REPETITION_PENALTY)] = 1.0  # vLLM
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_TOKENS)
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema
    guided_json: dict[str, Any] | str | None = None  # vLLM: a JSON schema
    guided_regex: str | None = Field(default=None, max_length=10_000)  # vLLM
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=256)  # vLLM
    # the router's admission queue: lower first (vLLM); whose turn (without API keys)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    user: str | None = Field(default=None, max_length=256)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit() or int(token) >= 2**31:
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if value not in LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in {LOGIT_BIAS}, got {value}")
        return bias

    @model_validator(mode="after")
    def _supported(self) -> "OpenAIRequest":
        asked = {k for k, v in (self.model_extra or {}).items() if not _neutral(k, v)}
        unsupported = sorted((asked & UNSUPPORTED_FIELDS) - IGNORED_FIELDS)
        if unsupported:
            raise ValueError(f"not supported by this server: {', '.join(unsupported)}")
        unknown = sorted(asked - UNSUPPORTED_FIELDS - IGNORED_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        self.structured()  # a malformed grammar request is a 400 here
        for stop in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            _check_text(stop, "stop")
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids or ()):
            raise ValueError("stop_token_ids must be token ids (non-negative)")
        return self

    def logprobs_wanted(self) -> int | None:
        """How many top logprobs per token the client wants (None: no logprobs)."""
        return None

    def structured(self) -> tuple[str, str] | None:
        """The grammar the output must follow, as (kind, spec); None: free text. Raises
        ValueError for a malformed `response_format` or more than one grammar."""
        asked: list[tuple[str, str]] = []
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            asked.append(("json", ""))
        elif kind == "json_schema":
            schema = (self.response_format or {}).get("json_schema", {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs json_schema.schema, an object")
            asked.append(("json_schema", json.dumps(schema)))
        elif kind != "text":
            raise ValueError("response_format type must be text, json_object or json_schema")
        if self.guided_json is not None:
            schema_text = (
                self.guided_json
                if isinstance(self.guided_json, str)
                else json.dumps(self.guided_json)
            )
            asked.append(("json_schema", schema_text))
        if self.guided_regex is not None:
            asked.append(("regex", self.guided_regex))
        if self.guided_choice is not None:
            asked.append(("choice", json.dumps(self.guided_choice)))
        if len(asked) > 1:
            raise ValueError(
                "give one of response_format, guided_json, guided_regex, guided_choice"
            )
        return asked[0] if asked else None

    def generations(self) -> int:
        """Choices to generate (`best_of` of them are ranked down to `n`)."""
        return self.n

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k in (None, -1, 0) else self.top_k,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens or DEFAULT_MAX_TOKENS),
            logit_bias=tuple(sorted((int(t), b) for t, b in (self.logit_bias or {}).items())),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logprobs=self.logprobs_wanted(),
            structured=self.structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int | None, _within(LOGPROBS)] = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    echo: bool = False  # the prompt (and, with logprobs, its logprobs) before the completion
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)  # 0: with echo

    @property
    def prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt's logprobs, nothing generated (how
        evaluation harnesses score log-likelihoods)."""
        return self.echo and self.max_tokens == 0

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def generations(self) -> int:
        return max(self.n, self.best_of or 1)

    @model_validator(mode="after")
    def _single_prompt(self) -> "CompletionRequest":
        prompt = self.prompt
        if (
            isinstance(prompt, list)
            and prompt
            and not isinstance(prompt[0], int)
            and len(prompt) != 1
        ):
            raise ValueError("a batch of prompts is not supported; send one prompt per request")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be at least n")
        if self.stream and self.generations() > self.n:
            raise ValueError("best_of > n cannot be streamed")
        single = self.single_prompt()
        if isinstance(single, str):
            _check_text(single, "prompt")
        return self

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt[0]
        return prompt  # type: ignore[return-value]

    def params(self) -> SamplingParams:
        params = self.sampling_params(1 if self.prompt_only else self.max_tokens)
        if self.echo and self.logprobs is not None:
            params = replace(params, prompt_logprobs=self.logprobs)
        return params


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    """A call an earlier assistant message made (sent back in the conversation)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_call(self) -> dict[str, Any]:
        """As chat templates expect it: the arguments as an object, not JSON text."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            raise ValueError(f"tool call {self.id}: its arguments are not JSON") from None
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. `refusal`, `audio` of earlier answers

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _calls_parse(self) -> "ChatMessage":
        for call in self.tool_calls or ():
            call.template_call()
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (`developer` is a system message there)."""
        role = {"developer": "system"}.get(self.role, self.role)
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    @field_validator("content")
    @classmethod
    def _unicode(cls, content: Any) -> Any:
        if isinstance(content, str):
            _check_text(content, "message content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part.get("text"), str):
                _check_text(part["text"], "message content")
        return content

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


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes none
    strict: bool | None = None  # required / named calls always follow the schema here

    def parameters_schema(self) -> dict[str, Any]:
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: Annotated[int | None, _within(LOGPROBS)] = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (with "required")

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _chat_supported(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: two functions have the same name")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        return self

    def tool_mode(self) -> str:
        """none (tools ignored) | auto (the model decides) | required | named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def named_tool(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def structured(self) -> tuple[str, str] | None:
        """A required or named tool call is a grammar too: the calls' JSON schema."""
        asked = super().structured()
        mode = self.tool_mode()
        if mode not in ("required", "named"):
            return asked
        if asked is not None:
            raise ValueError(
                "tool_choice required or a named function cannot be combined with "
                "response_format or guided_* (both constrain the output)"
            )
        functions = {t.function.name: t.function.parameters_schema() for t in self.tools or ()}
        named = self.named_tool()
        if named is not None and named not in functions:
            raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
        if named is not None:
            return ("json_schema", json.dumps(functions[named]))
        schema = tool_calls.required_schema(
            list(functions.items()), self.parallel_tool_calls is False
        )
        return ("json_schema", json.dumps(schema))

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none with `tool_choice: "none"`)."""
        if self.tool_mode() == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_completion_tokens or self.max_tokens)

    def chat_messages(self) -> list[dict[str, Any]]:
        return [message.template_message() for message in self.messages]


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages (rendered with the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None:
            _check_text(self.prompt, "prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
