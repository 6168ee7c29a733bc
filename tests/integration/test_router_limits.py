"""The router's explicit concurrency limit over real PD instances: past
`router.max_concurrent_requests` running generations a request gets 503 with Retry-After (and
is counted), never a silent queue; the generations it runs are unaffected, and once one ends the
next request is served."""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from credentials import SECRET
from waiting import wait_for

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig
from services.decode.servicer import serve_decode
from services.prefill.servicer import serve_prefill
from services.router.server import RunningRouter, serve_router


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path) -> Iterator[RunningRouter]:
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256)
    p, p_server, p_port = serve_prefill(config, PrefillConfig(), secret=SECRET)
    d, d_server, d_port = serve_decode(config, DecodeConfig(), secret=SECRET)
    running = serve_router(
        RouterConfig(port=0, model_name="tiny", max_concurrent_requests=2),
        config, [f"127.0.0.1:{p_port}"], [f"127.0.0.1:{d_port}"], secret=SECRET,
    )  # fmt: skip
    yield running
    running.stop()
    for instance, server in ((p, p_server), (d, d_server)):
        server.stop(0)
        instance.check_integrity()
        instance.stop()


def test_past_the_limit_requests_get_503_and_the_running_ones_finish(
    router: RunningRouter,
) -> None:
    url = f"{router.url}/v1/completions"
    long = {"model": "tiny", "prompt": "a long story", "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as a,
        httpx.Client(timeout=60) as b,
        a.stream("POST", url, json=long) as first,
        b.stream("POST", url, json=long) as second,
    ):
        streams = [first.iter_lines(), second.iter_lines()]
        for lines in streams:  # both are generating
            assert next(line for line in lines if line.startswith("data: {"))
        refused = httpx.post(url, json={**long, "stream": False, "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "no_capacity" and "max_concurrent_requests" in error["message"]
        two = httpx.post(url, json={**long, "stream": False, "n": 2, "max_tokens": 4})
        assert two.status_code == 503  # choices count as generations
        events = [json.loads(line[6:]) for line in streams[0] if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: router.router.num_running == 0)  # the closed stream is aborted
    served = httpx.post(url, json={**long, "stream": False, "max_tokens": 4}, timeout=30)
    assert served.status_code == 200
    metrics = httpx.get(f"{router.url}/metrics").text
    assert "pdserve_router_rejected_requests_total 2.0" in metrics
