"""pdserve's decoder against Hugging Face `transformers` on the same weights (fp32).

Logits must agree within 1e-4 and greedy tokens must be identical: for one prompt, a batch of
prompts of different lengths, chunked prefill, a continuation that hits the prefix cache and 200
decode steps; for Llama (tied and untied), Qwen2 (q/k/v bias), llama3 RoPE scaling, a
checkpoint written by `transformers` itself, Qwen3 (per-head q and k norms), the
mixture-of-experts Qwen3-MoE and Mixtral, and DeepSeek-V3 and V2 (latent attention).
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from reference import (
    decisive_weights,
    deepseek_v2_config,
    deepseek_v3_config,
    hf_greedy,
    hf_logits,
    hf_model,
    quantize_checkpoint,
    write_with_tokenizer,
)
from transformers import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.model.kv_quant import FP8
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, SequenceChunk
from pdserve.model.tiny import write_tiny_model

ATOL = 1e-4
BLOCK = 16


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 * offset + 11) % 250 for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return hf_model(tiny_model_dir)


# the shapes of the checkpoints written here by transformers' own classes
SMALL: dict[str, object] = {
    "vocab_size": 262,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def assert_engine_matches(
    path: Path, reference: torch.nn.Module, make_engine: Callable[..., LLMEngine], steps: int
) -> None:
    """The checkpoint at `path` against `reference`: last-position logits of a 100-token prompt,
    and `steps` greedy tokens of two prompts decoded in one batch by an engine."""
    assert_last_logits_match(path, reference, prompt(100), blocks=7)
    prompts = [prompt(n, offset=n) for n in (9, 40)]
    completions = make_engine(model=str(path), block_size=BLOCK).generate(prompts, greedy(steps))
    for tokens, completion in zip(prompts, completions, strict=True):
        assert list(completion.token_ids) == hf_greedy(reference, tokens, steps)


def assert_last_logits_match(
    path: Path, reference: torch.nn.Module, tokens: list[int], blocks: int
) -> None:
    logits = runner_for(path).execute(
        [SequenceChunk(tokens, 0, list(range(blocks)), needs_logits=True)]
    )
    torch.testing.assert_close(logits[0], hf_logits(reference, tokens)[-1], atol=ATOL, rtol=0)


def runner_for(path: Path, num_blocks: int = 64) -> ModelRunner:
    loaded = load_model(path)
    return ModelRunner.create(loaded.model, num_blocks, BLOCK, loaded.dtype)


def test_logits_match_reference_single_prompt(
    tiny_model_dir: Path, reference: torch.nn.Module
) -> None:
    tokens = prompt(45)
    runner = runner_for(tiny_model_dir)
    logits = runner.execute([SequenceChunk(tokens, 0, [3, 1, 4], needs_logits=True)])
    torch.testing.assert_close(logits[0], hf_logits(reference, tokens)[-1], atol=ATOL, rtol=0)


def test_logits_match_reference_batch_of_different_lengths(
    tiny_model_dir: Path, reference: torch.nn.Module
) -> None:
    prompts = [prompt(n, offset=n) for n in (1, 15, 16, 17, 40)]
    runner = runner_for(tiny_model_dir)
    tables = [[0], [1], [2], [3, 4], [5, 6, 7]]
    chunks = [
        SequenceChunk(p, 0, t, needs_logits=True) for p, t in zip(prompts, tables, strict=True)
    ]
    logits = runner.execute(chunks)
    for row, tokens in enumerate(prompts):
        torch.testing.assert_close(logits[row], hf_logits(reference, tokens)[-1], atol=ATOL, rtol=0)


def test_logits_match_reference_chunked_prefill_and_decode(
    tiny_model_dir: Path, reference: torch.nn.Module
) -> None:
    tokens = prompt(70)
    table = [9, 2, 30, 5, 11]
    runner = runner_for(tiny_model_dir)
    runner.execute([SequenceChunk(tokens[:20], 0, table, needs_logits=False)])
    runner.execute([SequenceChunk(tokens[20:33], 20, table, needs_logits=False)])
    last = runner.execute([SequenceChunk(tokens[33:], 33, table, needs_logits=True)])
    expected = hf_logits(reference, tokens)
    torch.testing.assert_close(last[0], expected[-1], atol=ATOL, rtol=0)
    step = runner.execute([SequenceChunk([42], 70, table, needs_logits=True)])
    torch.testing.assert_close(step[0], hf_logits(reference, [*tokens, 42])[-1], atol=ATOL, rtol=0)


def test_logits_match_reference_over_200_decode_steps(
    tiny_model_dir: Path, reference: torch.nn.Module
) -> None:
    tokens = prompt(30)
    table = list(range(20))
    runner = runner_for(tiny_model_dir)
    sequence = list(tokens)
    step_logits = [runner.execute([SequenceChunk(tokens, 0, table, needs_logits=True)])[0]]
    for _ in range(200):
        sequence.append(int(step_logits[-1].argmax()))
        chunk = SequenceChunk([sequence[-1]], len(sequence) - 1, table, needs_logits=True)
        step_logits.append(runner.execute([chunk])[0])
    expected = hf_logits(reference, sequence)[len(tokens) - 1 :]
    torch.testing.assert_close(torch.stack(step_logits), expected, atol=ATOL, rtol=0)


def test_greedy_tokens_match_reference_for_200_steps_in_a_batch(
    tiny_model_dir: Path, reference: torch.nn.Module, make_engine: Callable[..., LLMEngine]
) -> None:
    prompts = [prompt(n, offset=n) for n in (5, 23, 48)]
    engine = make_engine()
    completions = engine.generate(prompts, greedy(200))
    for tokens, completion in zip(prompts, completions, strict=True):
        assert list(completion.token_ids) == hf_greedy(reference, tokens, 200)
        assert completion.finish_reason == "length"


def test_greedy_tokens_match_reference_with_chunked_prefill(
    tiny_model_dir: Path, reference: torch.nn.Module, make_engine: Callable[..., LLMEngine]
) -> None:
    tokens = prompt(150)
    engine = make_engine(max_num_batched_tokens=32)
    [completion] = engine.generate([tokens], greedy(20))
    assert list(completion.token_ids) == hf_greedy(reference, tokens, 20)


def test_greedy_tokens_match_reference_on_prefix_cache_hit(
    tiny_model_dir: Path, reference: torch.nn.Module, make_engine: Callable[..., LLMEngine]
) -> None:
    first = prompt(64)
    continuation = [*first, *prompt(21, offset=5)]
    engine = make_engine()
    engine.generate([first], greedy(4))
    [completion] = engine.generate([continuation], greedy(30))
    assert completion.num_cached_tokens == 64
    assert list(completion.token_ids) == hf_greedy(reference, continuation, 30)


@pytest.mark.parametrize(
    ("architecture", "tied"),
    [
        ("LlamaForCausalLM", True),
        ("Qwen2ForCausalLM", False),
        ("Qwen2ForCausalLM", True),
        ("Qwen3ForCausalLM", False),
        ("Qwen3ForCausalLM", True),
        ("Qwen3MoeForCausalLM", False),
        ("MixtralForCausalLM", True),
    ],
)
def test_model_variants_match_reference(tmp_path: Path, architecture: str, tied: bool) -> None:
    path = write_tiny_model(tmp_path / "m", seed=3, architecture=architecture, tied=tied)
    reference = hf_model(path)
    tokens = prompt(37)
    logits = runner_for(path).execute([SequenceChunk(tokens, 0, [0, 1, 2], needs_logits=True)])
    torch.testing.assert_close(logits[0], hf_logits(reference, tokens)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {  # DeepSeek's: the cos/sin scale from mscale / mscale_all_dim
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-mscale"],
)
def test_checkpoint_written_by_transformers_loads_and_matches(
    tmp_path: Path, tiny_model_dir: Path, rope: dict[str, object]
) -> None:
    torch.manual_seed(5)
    reference = LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters=rope)).eval()
    write_with_tokenizer(reference, tmp_path, tiny_model_dir)
    assert_last_logits_match(tmp_path, reference, prompt(200), blocks=13)


def test_a_qwen3_checkpoint_matches_with_its_per_head_q_and_k_norms(
    tmp_path: Path, tiny_model_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """Qwen3: an RMSNorm over every q and k head before the rotation, heads wider than
    hidden / heads, no q/k/v bias. Written by transformers' own classes; the norms' weights are
    drawn at random (initialized, they are ones: the test would not see them)."""
    torch.manual_seed(7)
    reference = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=48)).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    write_with_tokenizer(reference, tmp_path, tiny_model_dir)
    assert_engine_matches(tmp_path, reference, make_engine, steps=60)


EXPERTS: dict[str, object] = {"num_experts_per_tok": 2}


@pytest.mark.parametrize(
    ("family", "config"),
    [
        # experts in every second layer, top-k weights as the softmax gave them
        (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **SMALL,
                **EXPERTS,
                num_experts=8,
                moe_intermediate_size=64,
                decoder_sparse_step=2,
                norm_topk_prob=False,
            ),
        ),
        # experts in every layer but the first (`mlp_only_layers`), top-k weights renormalised
        (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **SMALL,
                **EXPERTS,
                num_experts=8,
                moe_intermediate_size=64,
                mlp_only_layers=[0],
                norm_topk_prob=True,
            ),
        ),
        (
            MixtralForCausalLM,
            MixtralConfig(**{**SMALL, "intermediate_size": 64}, **EXPERTS, num_local_experts=4),
        ),
    ],
    ids=["qwen3-moe-sparse-step-2", "qwen3-moe-mlp-only-layers", "mixtral"],
)
def test_a_mixture_of_experts_checkpoint_matches(
    tmp_path: Path,
    tiny_model_dir: Path,
    make_engine: Callable[..., LLMEngine],
    family: type[torch.nn.Module],
    config: PretrainedConfig,
) -> None:
    """Qwen3-MoE and Mixtral checkpoints written by transformers' own classes. The routers'
    weights are drawn wide (initialized, every expert scores alike and routes would hang on
    rounding), the norms' at random."""
    torch.manual_seed(11)
    reference = family(config).eval()  # type: ignore[call-arg]
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith("gate.weight"):
                parameter.normal_(0.0, 0.5)
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)
    write_with_tokenizer(reference, tmp_path, tiny_model_dir)
    assert_engine_matches(tmp_path, reference, make_engine, steps=40)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        (DeepseekV3ForCausalLM, {}),
        (DeepseekV3ForCausalLM, {"q_lora_rank": None, "rope_interleave": False}),
        (
            DeepseekV3ForCausalLM,
            {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "norm_topk_prob": False},
        ),
        (DeepseekV2ForCausalLM, {"q_lora_rank": None}),
        (DeepseekV2ForCausalLM, {"topk_method": "group_limited_greedy", "n_shared_experts": 2}),
    ],
    ids=[
        "v3-q-lora",
        "v3-plain-q-half-split-rope",
        "v3-all-sparse-one-group",
        "v2-greedy",
        "v2-group-limited",
    ],
)
def test_a_deepseek_checkpoint_matches(
    tmp_path: Path,
    tiny_model_dir: Path,
    make_engine: Callable[..., LLMEngine],
    family: type[torch.nn.Module],
    overrides: dict[str, object],
) -> None:
    """DeepSeek-V3 and V2 written by transformers' own classes: latent attention (with and
    without the query bottleneck, interleaved and half-split rotary), YaRN with DeepSeek's
    mscale, each routing (V3's sigmoid groups with the correction bias, V2's softmax, greedy or
    in groups), shared experts, the first layers dense. Prefill expands the latent, decode
    attends in it: both against transformers' expanded attention."""
    make_config = deepseek_v3_config if family is DeepseekV3ForCausalLM else deepseek_v2_config
    model = family(make_config(SMALL["vocab_size"], **overrides))  # type: ignore[call-arg, arg-type]
    reference = decisive_weights(model, seed=5).eval()
    write_with_tokenizer(reference, tmp_path, tiny_model_dir)
    assert_engine_matches(tmp_path, reference, make_engine, steps=40)


def test_a_deepseek_v3_checkpoint_of_fp8_weights_matches_what_it_stands_for(
    tmp_path: Path, tiny_model_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """DeepSeek-V3's own checkpoint format: every decoder projection block-quantized to FP8
    (`weight_scale_inv` per block), the routers and norms not. pdserve keeps the weights in
    FP8 (half a bfloat16 copy's bytes) and dequantizes them as it multiplies: logits and
    greedy tokens equal transformers' on the dequantized weights."""
    model = decisive_weights(DeepseekV3ForCausalLM(deepseek_v3_config(SMALL["vocab_size"])), 5)
    fp8 = quantize_checkpoint(write_with_tokenizer(model, tmp_path / "fp8", tiny_model_dir), (8, 8))
    loaded = load_model(fp8)
    attention = loaded.model.model.decoder_layers()[1].self_attn
    assert attention.q_b_proj is not None and attention.q_b_proj.weight.dtype == FP8
    assert loaded.model.model.decoder_layers()[1].mlp.experts.gate_up.dtype == FP8
    assert_engine_matches(fp8, hf_model(fp8), make_engine, steps=40)
