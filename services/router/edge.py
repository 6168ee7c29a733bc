"""The HTTP edge's checks of a request before the router runs it: the model name, the prompt's
tokens and their fit in the model's context window. Each raises the typed error that becomes a
4xx; none touches the router's state."""

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.engine.request import SamplingParams
from pdserve.errors import InvalidRequestError, ModelNotFoundError, PromptTooLongError
from services.router.model_info import ModelInfo


class RequestEdge:
    """Stateless and thread-safe."""

    def __init__(self, model: ModelInfo) -> None:
        self.model = model

    def check_model(self, name: str) -> None:
        if name != self.model.model_id:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist; this server serves {self.model.model_id!r}"
            )

    def tokenize(self, prompt: str) -> list[int]:
        return self.model.tokenizer.encode(prompt)

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        return self.model.tokenizer.encode_chat(messages, tools)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})")
        return self.model.tokenizer.decode(token_ids)

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        limit = self.model.max_model_len
        if len(token_ids) >= limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens; "
                f"the prompt has {len(token_ids)} tokens (at least one is needed for output)"
            )
        if len(token_ids) + params.max_tokens > limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(token_ids) + params.max_tokens} ({len(token_ids)} in the prompt, "
                f"{params.max_tokens} to generate): lower max_tokens to at most "
                f"{limit - len(token_ids)}"
            )
