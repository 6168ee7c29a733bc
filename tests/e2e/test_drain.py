"""Stopping `pdserve up` drains it: new requests are refused with a 503, the ones in flight end
whole, then it exits cleanly."""

import json
import signal
import threading
from pathlib import Path

import httpx
import ray
from pdserve_up import pdserve_up
from waiting import wait_for


def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_ones(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 128\n"
        f"prefill:\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-drain\n  state_dir: {tmp_path}\n  drain_timeout_s: 60\n"
    )
    with pdserve_up(config, tmp_path, ray.get_runtime_context().gcs_address) as up:
        url = f"{up.router_url}/completions"
        body = {"model": tiny_model_dir.name, "prompt": "on and on", "max_tokens": 600,
                "ignore_eos": True, "stream": True}  # fmt: skip
        chunks: list[dict[str, object]] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", url, json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line.removeprefix("data: ")))
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        up.process.send_signal(signal.SIGTERM)

        def refused() -> bool:
            reply = httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=30)
            return reply.status_code == 503 and "Retry-After" in reply.headers

        wait_for(refused, 10)
        reader.join(120)
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))  # type: ignore[index]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]  # type: ignore[index]
        assert finishes[-1] == "length" and text
        assert up.process.wait(timeout=90) == 0
