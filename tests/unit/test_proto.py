"""The generated code in pdserve/v1/ must match proto/ (run `make proto` after editing a .proto)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-Iproto",
            f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}", *protos,
        ],
        cwd=ROOT, check=True, env=env, capture_output=True,
    )  # fmt: skip
    generated = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py*")}
    committed = {
        p.relative_to(ROOT): p.read_bytes() for p in (ROOT / "pdserve" / "v1").glob("*_pb2*.py*")
    }
    assert len(generated) == 3 * 4
    stale = sorted(str(path) for path in generated if committed.get(path) != generated[path])
    extra = sorted(str(path) for path in set(committed) - set(generated))
    assert not stale and not extra, f"run `make proto`: stale {stale}, unexpected {extra}"
