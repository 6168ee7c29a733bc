"""The HTTP edge's checks of a request before the router runs it: the model name, the prompt's
tokens and their fit in the model's context window. Each raises the typed error that becomes a
4xx; none touches the router's state."""

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.engine.request import SamplingParams
from pdserve.engine.validation import validate_request
from pdserve.errors import InvalidRequestError, ModelNotFoundError
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
        """Raise InvalidRequestError / PromptTooLongError unless the prompt and `max_tokens`
        fit the model (`validate_request`)."""
        model = self.model
        validate_request(
            token_ids, params, vocab_size=model.vocab_size, max_model_len=model.max_model_len
        )
