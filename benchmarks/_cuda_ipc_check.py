"""CUDA IPC KV transfer on a GPU host: pdserve's `CudaIpcKVTransport` between two processes.

    from _cuda_ipc_check import exercise_cuda_ipc  # benchmarks/ on sys.path (gpu_check has it)
    result = exercise_cuda_ipc(timeout_s=120)       # a JSON-ready dict; never raises
    python benchmarks/_cuda_ipc_check.py [--blocks 256] [--block-bytes 2097152] [--timeout-s 120]

Per pair of GPUs (two processes on GPU 0; and GPU 0 -> GPU 1 when two are visible), a child
process plays decode: it sees the GPUs as a pdserve GPU actor does (its own first:
`services.controller.actors.visible_devices`, so its index 0 is not the parent's), allocates a
zeroed KV cache and exports it (`export_kv_cache`, what a decode instance sends in its Reserve
reply). The parent plays prefill: `can_reach` (same host, the child's GPU found by UUID, the
mapping opened: `open_peer_cache`), then `write_blocks` (what `send_blocks` does before its
commit, which needs a decode instance) for one long run and for scattered block ids, and
`write_views` from pinned host memory; the child checks every written block's bytes (SHA-256 in
block order) and that no other block changed. Time: `write_blocks` returns once an event after
the copies completed, so GB/s is bytes / its wall time (median of `repeats`).

`{"skipped": "no CUDA"}` without a GPU; a pair that fails is `{"error": ...}` with the child's
stderr tail, and the others still run.
"""

import argparse
import contextlib
import hashlib
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pdserve.rpc.auth import new_secret  # noqa: E402
from pdserve.rpc.channels import ChannelPool  # noqa: E402
from pdserve.transfer.base import KVEndpoints, KVTarget, host_id  # noqa: E402
from pdserve.transfer.cuda_ipc import (  # noqa: E402
    CudaIpcKVTransport,
    export_kv_cache,
    unreachable_reason,
    visible_gpus,
)
from pdserve.transfer.direct import copy_runs  # noqa: E402
from services.controller.actors import visible_devices  # noqa: E402

BLOCK_BYTES = 2 * 2**20  # a Llama-3-8B block: 32 layers x K,V x 16 tokens x 8 heads x 128 x 2 B
NUM_BLOCKS = 256  # 512 MiB of cache per process
REPEATS = 5
REPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Source:
    """The sender's KV cache as `CudaIpcKVTransport.write_blocks` reads it (a `KVSource`)."""

    block_bytes: int
    base_address: int
    device: torch.device


def exercise_cuda_ipc(
    num_blocks: int = NUM_BLOCKS,
    block_bytes: int = BLOCK_BYTES,
    timeout_s: float = 120.0,
    repeats: int = REPEATS,
) -> dict[str, Any]:
    """Every pair's figures and checks (see the module docstring); `ok` when all passed."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    count = torch.cuda.device_count()
    deadline = time.monotonic() + timeout_s
    result: dict[str, Any] = {"gpus": count, "block_bytes": block_bytes, "pairs": []}
    for sender, receiver in [(0, 0), *([(0, 1)] if count > 1 else [])]:
        entry: dict[str, Any] = {"sender": f"cuda:{sender}", "receiver": f"cuda:{receiver}"}
        try:
            entry.update(_pair(sender, receiver, num_blocks, block_bytes, repeats, deadline))
        except Exception as e:  # recorded: the next pair still runs
            entry.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        result["pairs"].append(entry)
    result["ok"] = all(p.get("ok") is True for p in result["pairs"])
    return result


def _pair(
    sender: int, receiver: int, num_blocks: int, block_bytes: int, repeats: int, deadline: float
) -> dict[str, Any]:
    device = torch.device("cuda", sender)
    entry: dict[str, Any] = {
        "peer_access": sender == receiver or torch.cuda.can_device_access_peer(sender, receiver)
    }
    with _decode_process(receiver, num_blocks, block_bytes, deadline) as decode:
        hello = decode.hello
        entry["decode_visible_devices"] = hello["visible"]
        endpoints = KVEndpoints(
            host_id=hello["host_id"],
            kv_bytes=num_blocks * block_bytes,
            cuda_ipc_handle=bytes.fromhex(hello["handle"]),
            gpu_uuid=hello["uuid"],
        )
        transport = CudaIpcKVTransport(ChannelPool(new_secret()), device)
        try:
            reason = unreachable_reason(endpoints, device, visible_gpus)
            if reason or not transport.can_reach(_target(endpoints, "probe", [0], block_bytes)):
                return {**entry, "ok": False, "error": reason or "mapping failed (see the log)"}
            cache = torch.randint(
                0, 256, (num_blocks, block_bytes), dtype=torch.uint8, device=device
            )
            source = Source(block_bytes, cache.data_ptr(), device)
            rounds = {}
            for name, (sources, destinations) in _patterns(num_blocks).items():
                target = _target(endpoints, name, destinations, block_bytes)
                rounds[name] = _round(transport, target, source, cache, sources, decode, repeats)
            rounds["host_views"] = _host_round(transport, endpoints, cache, decode, block_bytes)
        finally:
            transport.close()  # unmapped before the child exits
    entry["rounds"] = rounds
    entry["ok"] = all(r["ok"] for r in rounds.values())
    return entry


def _patterns(num_blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    """(source ids, decode ids): half the cache as one run on both sides, and half of it at
    random ids on both sides (runs of about one block: one copy each)."""
    half = num_blocks // 2
    rng = random.Random(16)
    return {
        "one_run": (list(range(half)), list(range(half, 2 * half))),
        "scattered": (rng.sample(range(num_blocks), half), rng.sample(range(num_blocks), half)),
    }


def _target(endpoints: KVEndpoints, name: str, ids: Sequence[int], size: int) -> KVTarget:
    return KVTarget("cuda-ipc-check", name, 0, tuple(ids), size, endpoints)


def _round(
    transport: CudaIpcKVTransport,
    target: KVTarget,
    source: Source,
    cache: torch.Tensor,
    sources: list[int],
    decode: "_Decode",
    repeats: int,
) -> dict[str, Any]:
    decode.call("reset")
    seconds = [transport.write_blocks(target, source, sources).seconds for _ in range(repeats)]
    addresses = [source.base_address + b * source.block_bytes for b in sources]
    runs = len(list(copy_runs(target.block_ids, addresses, source.block_bytes)))
    return _verdict(decode, target, _digest(cache, sources), seconds, runs)


def _host_round(
    transport: CudaIpcKVTransport,
    endpoints: KVEndpoints,
    cache: torch.Tensor,
    decode: "_Decode",
    block_bytes: int,
) -> dict[str, Any]:
    """`write_views`: pinned host copies of a few blocks into scattered decode blocks."""
    destinations = random.Random(3).sample(range(len(cache)), min(8, len(cache)))
    ids = list(range(len(destinations)))
    host = cache[ids].cpu().pin_memory()
    views = [memoryview(row.numpy().data) for row in host]
    target = _target(endpoints, "host_views", destinations, block_bytes)
    decode.call("reset")
    seconds = [transport.write_views(target, views).seconds]
    return _verdict(decode, target, _digest(cache, ids), seconds, len(ids))


def _verdict(
    decode: "_Decode", target: KVTarget, expected: str, seconds: list[float], runs: int
) -> dict[str, Any]:
    answer = decode.call("verify", ids=list(target.block_ids))
    nbytes = len(target.block_ids) * target.block_bytes
    median = statistics.median(seconds)
    return {
        "ok": answer["digest"] == expected and answer["stray_bytes"] == 0,
        "digest_match": answer["digest"] == expected,
        "stray_bytes": answer["stray_bytes"],
        "blocks": len(target.block_ids),
        "copies": runs,
        "mib": nbytes / 2**20,
        "ms_first": seconds[0] * 1e3,  # with the first use's costs (streams, peer access)
        "ms_median": median * 1e3,
        "gbps_median": nbytes / median / 1e9,
        "gbps_best": nbytes / min(seconds) / 1e9,
    }


def _digest(cache: torch.Tensor, ids: Sequence[int]) -> str:
    rows = cache[torch.tensor(list(ids), device=cache.device)].cpu()
    return hashlib.sha256(rows.numpy().tobytes()).hexdigest()


# -- the decode process -----------------------------------------------------------------------


class _Decode:
    """The child: one JSON line per request on its stdin, one reply per line on its stdout."""

    def __init__(self, process: subprocess.Popen[str], deadline: float) -> None:
        self.process = process
        self.deadline = deadline
        self.replies: queue.Queue[str] = queue.Queue()
        self.errors: list[str] = []
        assert process.stdout is not None and process.stderr is not None
        threading.Thread(target=_pump, args=(process.stdout, self.replies.put), daemon=True).start()
        threading.Thread(target=_pump, args=(process.stderr, self._error), daemon=True).start()
        self.hello = self._reply()

    def _error(self, line: str) -> None:
        self.errors = [*self.errors[-30:], line.rstrip()]

    def _reply(self) -> dict[str, Any]:
        """The next reply line; raises TimeoutError, or RuntimeError when the child failed."""
        give_up = min(time.monotonic() + REPLY_TIMEOUT_S, self.deadline)
        while True:
            try:
                reply: dict[str, Any] = json.loads(self.replies.get(timeout=0.2))
                break
            except queue.Empty:
                exited = self.process.poll() is not None
                if exited and self.replies.empty():
                    time.sleep(0.2)  # its last lines may still be in the pumps
                    if self.replies.empty():
                        code = self.process.returncode
                        raise RuntimeError(
                            f"decode process exited ({code}): {self.errors[-8:]}"
                        ) from None
                if time.monotonic() > give_up:
                    raise TimeoutError(f"decode process silent: {self.errors[-5:]}") from None
        if "error" in reply:
            raise RuntimeError(f"decode process: {reply['error']} {self.errors[-5:]}")
        return reply

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        return self._reply()


def _pump(stream: IO[str], sink: Any) -> None:
    for line in stream:
        sink(line)


@contextmanager
def _decode_process(
    receiver: int, num_blocks: int, block_bytes: int, deadline: float
) -> Iterator[_Decode]:
    """The child on GPU `receiver` (this process's index), seeing the GPUs as an actor would."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    node = [g.strip() for g in inherited.split(",")] if inherited else None
    own = node[receiver] if node else str(receiver)
    visible = visible_devices(lambda: [own], inherited, torch.cuda.device_count)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible or "", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(Path(__file__).resolve()), "--decode-side"]
    command += ["--blocks", str(num_blocks), "--block-bytes", str(block_bytes)]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        decode = _Decode(process, deadline)
        try:
            yield decode
        finally:
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, ValueError):
                decode.call("stop")  # a failure inside the pair is the one to report
        process.wait(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _decode_side(num_blocks: int, block_bytes: int) -> None:
    """The child's loop: export a zeroed cache, then reset / verify / stop."""
    device = torch.device("cuda", 0)
    cache = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=device)
    export = export_kv_cache(cache)
    if export is None:
        _say({"error": "export_kv_cache shared nothing (see stderr)"})
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    _say({"handle": export.handle.hex(), "uuid": export.gpu_uuid, "host_id": host_id(),
          "visible": visible})  # fmt: skip
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "stop":
            _say({"stopped": True})
            return
        if request["op"] == "reset":
            cache.zero_()
            torch.cuda.synchronize(device)
            _say({"reset": True})
        else:  # verify
            ids = request["ids"]
            others = sorted(set(range(num_blocks)) - set(ids))
            stray = int(cache[others].count_nonzero().item()) if others else 0
            _say({"digest": _digest(cache, ids), "stray_bytes": stray})


def _say(reply: dict[str, Any]) -> None:
    print(json.dumps(reply), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="CUDA IPC KV transfer check")
    parser.add_argument("--blocks", type=int, default=NUM_BLOCKS)
    parser.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--decode-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_side:
        _decode_side(args.blocks, args.block_bytes)
        return
    result = exercise_cuda_ipc(args.blocks, args.block_bytes, args.timeout_s, args.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
