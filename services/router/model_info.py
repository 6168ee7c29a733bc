"""ModelInfo: what the router knows of the served model, read from its directory."""

from dataclasses import dataclass
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.engine.grammar import Grammars
from pdserve.kvcache.hashing import BlockHasher
from pdserve.model.config import ModelConfig
from pdserve.model.loader import eos_token_ids, model_tag
from pdserve.model.tiny import default_model_dir
from pdserve.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_id: str  # the name clients ask for
    tokenizer: Tokenizer
    hasher: BlockHasher  # the instances' block hashing: equal hashes mean equal prefixes
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    grammars: Grammars  # structured outputs' grammars, compiled once (a migration replays them)


def model_info(engine: EngineConfig, served_name: str | None) -> ModelInfo:
    """The model of `engine` as the router sees it, served as `served_name` (default: the
    model directory's name)."""
    path = Path(engine.model) if engine.model else default_model_dir()
    config = ModelConfig.from_dir(path)
    tokenizer = Tokenizer.from_dir(path)
    eos = eos_token_ids(config, tokenizer)
    return ModelInfo(
        model_id=served_name or path.name,
        tokenizer=tokenizer,
        hasher=BlockHasher.for_model(engine.block_size, model_tag(path, engine.dtype)),
        max_model_len=config.context_window(engine.max_model_len),
        vocab_size=config.vocab_size,
        eos_token_ids=eos,
        grammars=Grammars(tokenizer, config.vocab_size, eos),
    )
