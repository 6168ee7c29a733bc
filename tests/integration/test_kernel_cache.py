"""`engine.onednn_cache_entries` bounds what oneDNN's kernel caches hold: batches of ever new
row counts grow a CPU engine's heap by a few MB under a small cap, by a kernel (hundreds of KB)
per new shape under torch's default. Each engine runs in a process of its own (the caches' size
is read once per process)."""

import json
import subprocess
import sys
from pathlib import Path

# An engine with the given cap runs prompts of 120 lengths never seen before (one new shape of
# every projection each), then prints how much the malloc heap in use grew.
RUN = """
import ctypes, gc, json, sys
from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine, SamplingParams

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def heap():
    gc.collect()
    return libc.mallinfo2().uordblks / 2**20

engine = LLMEngine.from_config(EngineConfig(
    model=sys.argv[1], onednn_cache_entries=int(sys.argv[2]), enable_prefix_caching=False
))
params = SamplingParams(max_tokens=1, temperature=0.0)
for length in range(8, 24):
    engine.generate([[5] * length], params)
before = heap()
for length in range(24, 144):
    engine.generate([[5] * length], params)
print(json.dumps(heap() - before))
"""


def heap_growth_mb(model_dir: Path, entries: int) -> float:
    command = [sys.executable, "-c", RUN, str(model_dir), str(entries)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(json.loads(output.strip().splitlines()[-1]))


def test_a_small_cap_bounds_the_kernel_caches(tiny_model_dir: Path) -> None:
    capped = heap_growth_mb(tiny_model_dir, 16)
    uncapped = heap_growth_mb(tiny_model_dir, 1024)  # torch's default
    assert capped < 16, capped
    assert uncapped > 60, uncapped
