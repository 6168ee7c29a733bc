"""`benchmarks/soak.py --quick`: two minutes of a mixed load (completions streamed and not,
n = 2, chat with tools, chat streams with a JSON schema; PD and conditional paths) on a
3-node Ray cluster while an instance, a router replica, the embedded Redis and a whole node are
each killed once. Nothing may fail but requests on the killed router replica's connections,
every answer equals the answer before the chaos, and nothing is left held at the end."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_quick_soak_under_chaos_loses_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--clients", "3"],
        env={**os.environ, "BENCHMARK_RESULTS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    metrics, results = report["metrics"], report["results"]
    assert sorted(k["kind"] for k in results["kills"]) == ["instance", "node", "redis", "router"]
    assert metrics["failed_other"] == 0, results["failures"]
    assert metrics["wrong"] == 0, results["wrong_examples"]
    assert metrics["leaks"] == 0, results["leaks"]
    assert metrics["succeeded"] >= 40 and set(results["by_kind"].values()) != {0}
