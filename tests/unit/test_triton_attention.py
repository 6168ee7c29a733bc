"""The triton backend: its kernels equal the reference, checked in triton's interpreter on CPU
(tests/unit/triton_interpreted.py, run here in a fresh process with TRITON_INTERPRET=1), and
importing the backend does not import triton.

Why a subprocess: TRITON_INTERPRET=1 must be set before the process first imports
`triton.language` (its helpers are decorated for the interpreter or for the GPU then, once:
triton cannot be imported again in one process), and it stays in force for every kernel of that
process; setting it in the session's process would come too late or leak into later tests.
"""

import os
import subprocess
import sys
from pathlib import Path

INTERPRETED = Path(__file__).with_name("triton_interpreted.py")


def test_the_kernels_in_the_interpreter() -> None:
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(INTERPRETED),
            "-q",
            "-p",
            "no:cacheprovider",
            "--noconftest",
        ],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout, result.stdout[-2000:]


def test_importing_the_backend_leaves_triton_alone() -> None:
    code = (
        "import sys; import pdserve.model.triton_attention as t; "
        "assert 'triton' not in sys.modules, 'imported triton'; assert t.triton_available()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
