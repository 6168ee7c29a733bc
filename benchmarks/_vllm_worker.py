"""vs_vllm.py's vLLM side: `vllm.LLM` behind the JSON-lines loop of _peer_worker.py.

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python benchmarks/_vllm_worker.py SPEC_JSON

Runs under vLLM's own venv (scripts/install-vllm-cpu.sh), never under pdserve's (nothing here
is imported by pdserve, its tests or its type check). SPEC: ``model``, ``max_model_len``,
``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_bytes``, ``enforce_eager``,
``block_size`` (None: vLLM's CPU default, 128). The thread
count is the caller's `VLLM_CPU_OMP_THREADS_BIND`. float32, prefix caching on, seed 0.

`offline` is `LLM.generate` (token-id prompts, greedy, EOS ignored, detokenized as by default).
`stream` drives the engine under `LLM` by hand, as `LLM.generate` does: `llm_engine.add_request`
with `RequestOutputKind.DELTA`, then `llm_engine.step()` until the request is done; each step
that returns new tokens is timed when it returns, as pdserve's `LLMEngine.stream` yields.
"""

import itertools
import time
from typing import Any

from _peer_worker import Handler, serve, stream_reply

_probe_ids = itertools.count()


def make_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    block_size = {} if spec["block_size"] is None else {"block_size": int(spec["block_size"])}
    return LLM(
        **block_size,
        model=spec["model"],
        dtype="float32",
        max_model_len=int(spec["max_model_len"]),
        max_num_seqs=int(spec["max_num_seqs"]),
        max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
        kv_cache_memory_bytes=int(spec["kv_cache_bytes"]),
        enable_prefix_caching=True,
        enforce_eager=bool(spec["enforce_eager"]),
        seed=0,
    )


def load(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Handler]]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = make_llm(spec)

    def params(command: dict[str, Any], kind: Any = RequestOutputKind.FINAL_ONLY) -> Any:
        tokens = int(command["max_tokens"])
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, output_kind=kind)

    def offline(command: dict[str, Any]) -> dict[str, Any]:
        prompts = [{"prompt_token_ids": p} for p in command["prompts"]]
        start = time.perf_counter()
        done = llm.generate(prompts, params(command), use_tqdm=False)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "token_ids": [list(r.outputs[0].token_ids) for r in done],
            "cached_tokens": [r.num_cached_tokens or 0 for r in done],
        }

    def stream(command: dict[str, Any]) -> dict[str, Any]:
        engine = llm.llm_engine
        request_id = f"probe-{next(_probe_ids)}"
        times: list[float] = []
        tokens: list[int] = []
        start = time.perf_counter()
        prompt = {"prompt_token_ids": command["prompt"]}
        engine.add_request(request_id, prompt, params(command, RequestOutputKind.DELTA))
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                new = out.outputs[0].token_ids
                tokens.extend(new)
                times.extend(now for _ in new)
        return stream_reply(start, times, tokens)

    return describe(llm), {"offline": offline, "stream": stream}


def describe(llm: Any) -> dict[str, Any]:
    """The settings vLLM ended up with (after its CPU platform's adjustments)."""
    import torch
    import vllm

    config = llm.llm_engine.vllm_config
    return {
        "engine": "vllm",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "block_size": config.cache_config.block_size,
        "num_kv_blocks": config.cache_config.num_gpu_blocks,
        "max_model_len": config.model_config.max_model_len,
        "enforce_eager": config.model_config.enforce_eager,
        "compilation_mode": str(config.compilation_config.mode),
        "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "executor": config.parallel_config.distributed_executor_backend,
    }


if __name__ == "__main__":
    serve(load)
