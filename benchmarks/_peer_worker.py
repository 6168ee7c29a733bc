"""The JSON-lines loop shared by vs_vllm.py's two workers (standard library only: the vLLM worker
runs it under vLLM's own venv).

A worker is started as ``python <worker>.py SPEC_JSON``. It loads its engine, writes one line
``{"ready": true, ...}`` and then answers each command line read from stdin (``{"cmd": NAME,
...}``) with one JSON line; ``{"cmd": "quit"}`` ends it. Everything else the process (or a
library, or a child process it starts) prints goes to stderr: the protocol has a private copy of
the original stdout.

Both workers answer the same commands, timed inside the worker (the pipe is not timed):

* ``offline`` (``prompts``: token-id lists, ``max_tokens``): one batch, greedy, EOS ignored;
  replies ``seconds``, ``token_ids`` per prompt, ``cached_tokens`` per prompt;
* ``stream`` (``prompt``, ``max_tokens``): one request alone; replies ``ttft_s`` (request
  submitted -> first token handed to the caller), ``gaps_s`` (between consecutive tokens as the
  caller receives them), ``token_ids``.
"""

import gc
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def private_stdout() -> TextIO:
    """A copy of stdout for the protocol; fd 1 then points at stderr, for the process and its
    children alike (vLLM logs to stdout)."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return protocol


def serve(load: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Handler]]]) -> None:
    """Load the engine from the spec in argv[1], announce it, answer commands until `quit`."""
    protocol = private_stdout()
    spec = json.loads(sys.argv[1])
    start = time.perf_counter()
    info, handlers = load(spec)
    info = {"ready": True, "load_s": time.perf_counter() - start, **info}
    protocol.write(json.dumps(info) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        name = command.get("cmd")
        if name == "quit":
            break
        try:
            gc.collect()
            reply = handlers[name](command)
        except Exception as error:
            traceback.print_exc()
            reply = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(reply) + "\n")
    protocol.close()


def stream_reply(start: float, times: list[float], token_ids: list[int]) -> dict[str, Any]:
    """The `stream` reply from the submit time and each token's arrival time."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"ttft_s": times[0] - start, "gaps_s": gaps, "token_ids": token_ids}
