"""The OpenAI API, with the official `openai` client, against a cluster started by `pdserve up`
(2 prefill + 1 decode Ray actors, the router in the `up` process)."""

import json
import re
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import ray
import schemathesis
from hypothesis import HealthCheck, given, settings
from pdserve_up import CLI, UpCluster, pdserve_up
from waiting import wait_for

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2

MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpCluster]:
    workdir = tmp_path_factory.mktemp("openai-api")
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 512\n"
        f"  max_model_len: 1024\n"
        f"prefill:\n  replicas: 2\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  disaggregation: always\n  model_name: {MODEL}\n"
        f"  stats_interval_s: 0.1\n"
        f"admin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-openai-api\n  state_dir: {workdir}\n"
    )
    with pdserve_up(config, workdir, ray.get_runtime_context().gcs_address) as up:
        yield up
        for address in up.addresses("prefill") + up.addresses("decode"):
            stats = up.stats(address)
            assert stats.num_free_blocks == stats.num_blocks, address


@pytest.fixture(scope="module")
def client(cluster: UpCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=cluster.router_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(autouse=True)
def nothing_left_in_flight(cluster: UpCluster) -> Iterator[None]:
    yield

    def idle() -> bool:
        leases = [
            value
            for name, value in cluster.router_metrics().items()
            if name.startswith("pdserve_router_in_flight_requests{")
        ]
        decode = cluster.stats(cluster.addresses("decode")[0])
        return len(leases) >= 3 and not any(leases) and decode.num_running == 0

    wait_for(idle)


@pytest.fixture(scope="module")
def mixed(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=1024))


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_equals_mixed_mode_and_reports_usage(
    client: openai.OpenAI, mixed: LLMEngine
) -> None:
    prompt = "The quick brown fox"
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    [expected] = mixed.generate([prompt], SamplingParams(max_tokens=12))
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        len(mixed.tokenizer.encode(prompt)),
        len(expected.token_ids),
    )


def test_streamed_completion_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once", max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Once", max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_chat_equals_unstreamed_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert whole.usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_ends_the_completion(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0)
    stop = free.choices[0].text[6:9]
    stopped = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=24, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == free.choices[0].text[: free.choices[0].text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens < 24


def error_of(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "a" * 2000}, 400, "maximum context length"),
        ({"model": MODEL, "prompt": "hi", "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of must be"),
        ({"model": MODEL, "prompt": "hi", "best_of": 3, "stream": True}, 400, "streamed"),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, "batch of prompts"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "token ids"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"65": 101}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"9999999": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": 99}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"model": MODEL, "prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "0 only with echo"),
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "unknown field(s): frobnicate"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 2**32}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 4095}, 400, "lower max_tokens"),
        ({"model": MODEL, "prompt": "\ud800"}, 400, "not valid Unicode"),
    ],
)
def test_bad_requests_get_openai_errors(
    cluster: UpCluster, body: dict[str, object], status: int, fragment: str
) -> None:
    response = post_json(f"{cluster.router_url}/completions", body)
    assert response.status_code == status
    assert fragment in str(error_of(response)["message"])


def post_json(url: str, body: dict[str, object]) -> httpx.Response:
    """POST `body` as ASCII JSON: lone surrogates travel as `\\ud800` escapes, as a client's
    JSON encoder would send them."""
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=json.dumps(body), headers=headers, timeout=30)


def test_malformed_json_and_oversized_bodies_are_rejected(cluster: UpCluster) -> None:
    bad = httpx.post(
        f"{cluster.router_url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "JSON" in str(error_of(bad)["message"])
    huge = json.dumps({"model": MODEL, "prompt": "x" * (5 * 2**20)})
    too_big = httpx.post(
        f"{cluster.router_url}/completions",
        content=huge,
        headers={"content-type": "application/json"},
    )
    assert too_big.status_code == 413
    assert error_of(too_big)["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "not supported by this server: functions"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among the tools"),
        ({"max_completion_tokens": 2**32}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "bad \udcff"}]}, "not valid Unicode"),
    ],
)  # fmt: skip
def test_chat_features_not_honoured_get_400_naming_them(
    cluster: UpCluster, extra: dict[str, object], fragment: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = post_json(f"{cluster.router_url}/chat/completions", body)
    assert response.status_code == 400
    assert fragment in str(error_of(response)["message"])


def test_neutral_values_and_client_bookkeeping_fields_are_accepted(cluster: UpCluster) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "presence_penalty": 0, "logit_bias": {}, "user": "u1", "metadata": {"a": "b"},
            "tools": tools, "tool_choice": "none"}  # fmt: skip
    response = httpx.post(f"{cluster.router_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_top_k_and_stop_token_ids_reach_the_sampler(client: openai.OpenAI) -> None:
    def completion(**extra: object) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL, prompt="The sea", max_tokens=12, seed=5, extra_body=extra,
            temperature=2.0,
        )  # fmt: skip

    greedy = client.completions.create(model=MODEL, prompt="The sea", max_tokens=12, temperature=0)
    assert completion(top_k=1, ignore_eos=True).choices[0].text == greedy.choices[0].text
    assert completion(ignore_eos=True).choices[0].text != greedy.choices[0].text  # sampled
    tokens = httpx.post(
        str(client.base_url).replace("/v1/", "/tokenize"),
        json={"model": MODEL, "prompt": greedy.choices[0].text, "add_special_tokens": False},
    ).json()["tokens"]
    stopped = completion(top_k=1, stop_token_ids=[tokens[0]])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1


def test_logit_bias_and_penalties_reach_prefill_and_decode(cluster: UpCluster) -> None:
    base = cluster.router_url.removesuffix("/v1")
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    forced = post_json(f"{cluster.router_url}/completions", {**body, "logit_bias": {"77": 100}})
    expected = httpx.post(f"{base}/detokenize", json={"tokens": [77] * 6}).json()["prompt"]
    assert forced.json()["choices"][0]["text"] == expected
    plain = post_json(f"{cluster.router_url}/completions", body).json()["choices"][0]["text"]
    penalised = post_json(f"{cluster.router_url}/completions", {**body, "repetition_penalty": 2})
    assert penalised.status_code == 200 and penalised.json()["choices"][0]["text"] != plain


def test_n_choices_have_their_own_seed_streams_and_share_one_prefill(
    cluster: UpCluster, client: openai.OpenAI
) -> None:
    prompt = "The river, the hills and the quiet town by the sea. " * 3  # 3+ blocks; the tiny
    # model is peaked on some prompts (every seed then samples the same text)

    def computed() -> int:
        return sum(cluster.stats(a).num_computed_tokens for a in cluster.addresses("prefill"))

    before = computed()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=4,
                                      temperature=1.5, seed=11)  # fmt: skip
    after = computed()
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert len(set(texts)) == 4  # each choice samples its own stream (seed + index)
    assert first.usage is not None and first.usage.completion_tokens == 48
    prompt_tokens = first.usage.prompt_tokens
    assert after - before <= prompt_tokens + 3 * 16  # the others hit its KV (all but a block)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=4,
                                      temperature=1.5, seed=11)  # fmt: skip
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
        temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_best_of_keeps_the_choice_of_highest_cumulative_logprob(client: openai.OpenAI) -> None:
    asked = {"model": MODEL, "prompt": "The river", "max_tokens": 8, "temperature": 1.0,
             "seed": 21, "extra_body": {"ignore_eos": True}}  # fmt: skip
    every = client.completions.create(n=3, logprobs=0, **asked)  # type: ignore[arg-type]
    scores = {c.text: sum(c.logprobs.token_logprobs or []) for c in every.choices}  # type: ignore[union-attr]
    best = client.completions.create(best_of=3, **asked)  # type: ignore[arg-type]
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == max(scores, key=scores.__getitem__)
    assert best.usage is not None and best.usage.completion_tokens == 24  # all three generated


def test_tokenize_detokenize_and_models_report_the_context(cluster: UpCluster) -> None:
    base = cluster.router_url.removesuffix("/v1")
    tokenized = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "hello there"})
    assert tokenized.status_code == 200
    body = tokenized.json()
    models = httpx.get(f"{cluster.router_url}/models").json()
    context = models["data"][0]["max_model_len"]
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == context
    text = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert text.json()["prompt"] == "hello there"
    chat = httpx.post(
        f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}
    ).json()
    plain = httpx.post(f"{base}/tokenize", json={"prompt": "hello", "add_special_tokens": False})
    assert chat["count"] > plain.json()["count"]  # the chat template adds its markers
    bad = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad.status_code == 400 and "token ids" in str(error_of(bad)["message"])
    assert context == 1024  # the cluster's engine.max_model_len


def test_openapi_lists_the_statuses_served_and_labels_stay_bounded(cluster: UpCluster) -> None:
    base = cluster.router_url.removesuffix("/v1")
    document = httpx.get(f"{base}/openapi.json").json()
    responses = document["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in responses and {"200", "400", "503"} <= set(responses)
    for n in range(3):
        httpx.post(f"{base}/v1/nowhere-{n}", json={})
    metrics = cluster.router_metrics()
    assert metrics['pdserve_router_requests_total{endpoint="other",status="404"}'] >= 3
    assert not any("nowhere" in name for name in metrics)
    truncated = httpx.post(f"{cluster.router_url}/completions", content=b'{"model": "tiny", "pr',
                           headers={"content-type": "application/json"})  # fmt: skip
    assert truncated.status_code == 400 and error_of(truncated)["param"] is None


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            temperature=-1,
        )


def test_client_disconnect_aborts_the_request_everywhere(cluster: UpCluster) -> None:
    decode = cluster.addresses("decode")[0]
    # sampled (temperature 1): without ignore_eos an early EOS could end it before the check
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 900, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = f"{cluster.router_url}/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept: a discarded iterator closes the connection
        assert next(lines).startswith("data: ")
        assert cluster.stats(decode).num_running == 1
    wait_for(lambda: cluster.stats(decode).num_running == 0)
    # `nothing_left_in_flight` then checks that the router released every lease


def test_cache_aware_policy_sends_the_next_turn_to_the_instance_with_the_prefix(
    cluster: UpCluster, client: openai.OpenAI
) -> None:
    prefills = cluster.addresses("prefill")
    conversation = [{"role": "system", "content": "You are a helpful assistant. " * 8}]
    conversation.append({"role": "user", "content": "First question, about the weather?"})
    first = client.chat.completions.create(
        model=MODEL,
        messages=conversation,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )

    def indexed_blocks() -> int:  # the router has seen the first turn's KV events
        metrics = cluster.router_metrics()
        return sum(
            int(metrics.get(f'pdserve_router_indexed_blocks{{backend="{a}"}}', 0)) for a in prefills
        )

    wait_for(lambda: indexed_blocks() >= 4)
    before = [cluster.stats(a).device_hit_tokens for a in prefills]
    conversation.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    conversation.append({"role": "user", "content": "And a follow-up question?"})
    client.chat.completions.create(
        model=MODEL,
        messages=conversation,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    gained = sorted(
        cluster.stats(a).device_hit_tokens - b for a, b in zip(prefills, before, strict=True)
    )
    assert gained[0] == 0 and gained[1] >= 64  # all of it on one instance


def test_prometheus_discovers_and_can_scrape_every_endpoint(cluster: UpCluster) -> None:
    """file_sd JSON and the router's HTTP SD list the router and every instance; every
    endpoint's output passes `promtool check metrics`."""
    file_sd = json.loads((cluster.config.parent / "prometheus_targets.json").read_text())
    http_sd = httpx.get(f"{cluster.router_url.removesuffix('/v1')}/prometheus/targets").json()
    assert file_sd == http_sd
    assert sorted(g["labels"]["role"] for g in file_sd) == [
        "decode",
        "prefill",
        "prefill",
        "router",
    ]
    for group in file_sd:
        [target] = group["targets"]
        text = httpx.get(f"http://{target}/metrics", timeout=10).text
        assert "pdserve_" in text
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert check.returncode == 0, f"{target}: {check.stdout}{check.stderr}"


def exported_series(cluster: UpCluster) -> set[str]:
    """Names of every series the cluster's endpoints can export (from their `# TYPE` lines:
    counters as `_total`, histograms as `_bucket`/`_sum`/`_count`)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    names: set[str] = set()
    router = cluster.router_url.removesuffix("/v1")
    for url in [router] + [u.removesuffix("/metrics") for u in cluster.metrics_urls]:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                base = name.removesuffix("_total")
                names.update(base + s for s in suffixes.get(kind, [""]))
    return names


def test_dashboard_panels_parse_and_name_only_exported_metrics(
    cluster: UpCluster, tmp_path: Path
) -> None:
    root = Path(__file__).parents[2]
    dashboard = json.loads((root / "deploy" / "grafana" / "pdserve.json").read_text())
    panels = dashboard["panels"]
    assert "hit rate" in panels[0]["title"].lower()
    exprs = [t["expr"] for panel in panels for t in panel["targets"]]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"pdserve:panel_{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    rules_file = tmp_path / "panels.yml"
    rules_file.write_text(json.dumps(rules))  # JSON is YAML
    check = subprocess.run(
        ["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr  # every expression parses
    exported = exported_series(cluster)
    used = {name for e in exprs for name in re.findall(r"\bpdserve_[a-z_]+", e)}
    assert used and used <= exported, sorted(used - exported)
    config = root / "deploy" / "prometheus" / "prometheus.yml"
    check = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


# -- the admin API (these tests change the topology: they run last) -------------------------------


def admin_stub(cluster: UpCluster) -> tuple[admin_pb2_grpc.AdminServiceStub, str]:
    state = json.loads((cluster.config.parent / "cluster.json").read_text())
    token = (cluster.config.parent / "admin_token").read_text().strip()
    channel = grpc.insecure_channel(state["admin_address"])
    return admin_pb2_grpc.AdminServiceStub(channel), token


def test_admin_calls_need_the_bearer_token(cluster: UpCluster) -> None:
    stub, token = admin_stub(cluster)
    token_file = cluster.config.parent / "admin_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", token),)):
        with pytest.raises(grpc.RpcError) as denied:
            stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=metadata)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = stub.ListInstances(
        admin_pb2.ListInstancesRequest(), metadata=(("authorization", f"Bearer {token}"),)
    )
    assert sorted(i.name for i in reply.instances) == ["decode-0", "prefill-0", "prefill-1"]
    assert all(i.alive for i in reply.instances)


def test_an_operator_abort_ends_the_stream_with_an_error_not_a_bogus_finish_reason(
    cluster: UpCluster,
) -> None:
    stub, token = admin_stub(cluster)
    body = {"model": MODEL, "prompt": "on and on", "max_tokens": 800, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{cluster.router_url}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
        request_id = first["id"].removeprefix("cmpl-")
        reply = stub.AbortRequest(
            common_pb2.AbortRequest(request_id=request_id),
            metadata=(("authorization", f"Bearer {token}"),),
        )
        assert reply.found
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    reasons = {c.get("finish_reason") for e in events for c in e.get("choices", [])}
    assert "abort" not in reasons
    assert events[-1]["error"]["code"] == "request_aborted"


def test_admin_cli_prints_tables_and_json(cluster: UpCluster, client: openai.OpenAI) -> None:
    cli = [*CLI, "admin", "--config", str(cluster.config)]
    table = subprocess.run([*cli, "list"], capture_output=True, text=True, env=cluster.env)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:3] == ["name", "role", "address"]
    client.completions.create(model=MODEL, prompt="a message measured", max_tokens=2)
    listed = subprocess.run(
        [*cli, "list", "--json"], capture_output=True, text=True, env=cluster.env
    )
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["message_s"] > 0  # `pdserve simulate --from-cluster`'s
    stats = subprocess.run(
        [*cli, "cache-stats", "--json"], capture_output=True, text=True, env=cluster.env
    )
    assert stats.returncode == 0, stats.stderr
    assert {i["name"] for i in json.loads(stats.stdout)["instances"]} == {"prefill-0", "prefill-1"}
    bad = subprocess.run(
        [*cli, "list", "--token", "nope"], capture_output=True, text=True, env=cluster.env
    )
    assert bad.returncode == 2 and "UNAUTHENTICATED" in bad.stderr


def test_top_once_shows_every_instance_and_the_router_or_says_no_cluster_runs(
    cluster: UpCluster, client: openai.OpenAI, tmp_path: Path
) -> None:
    client.completions.create(model=MODEL, prompt="for top", max_tokens=4)  # a TTFT to show
    top = subprocess.run(
        [*CLI, "top", "--once", "--config", str(cluster.config)],
        capture_output=True,
        text=True,
        env=cluster.env,
    )
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    for name, (role, _) in cluster.instances.items():
        [row] = [line for line in lines if f" {name} " in line]
        assert role in row.split() and "alive" in row.split()
    assert [line.strip() for line in lines if line.strip() in ("instances", "router")] == [
        "instances",
        "router",
    ]
    [ttft] = [line for line in lines if "TTFT p50 / p99" in line]
    assert re.search(r"\d+\.\d ms / \d+\.\d ms", ttft), ttft
    assert "\x1b[" not in top.stdout  # piped: no colour codes
    nowhere = subprocess.run(
        [*CLI, "top", "--once", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=cluster.env,
    )
    assert nowhere.returncode == 3 and nowhere.stdout == ""
    assert nowhere.stderr.strip().splitlines() == [
        f"pdserve top: no running cluster: {tmp_path / 'cluster.json'} does not exist "
        "(is `pdserve up` running?)"
    ]


def test_a_drained_instance_gets_no_new_requests_while_its_in_flight_ones_finish(
    cluster: UpCluster, client: openai.OpenAI
) -> None:
    stub, token = admin_stub(cluster)
    auth = (("authorization", f"Bearer {token}"),)
    drained, other = cluster.addresses("prefill")
    name = next(n for n, (_, a) in cluster.instances.items() if a == drained)
    stream = client.completions.create(
        model=MODEL, prompt="a long one", max_tokens=120, temperature=0, stream=True
    )
    first = next(iter(stream))  # in flight now
    stub.DrainInstance(admin_pb2.InstanceRef(name=name), metadata=auth)
    rest = list(stream)
    assert first.choices and rest[-1].choices[0].finish_reason == "length"  # it finished
    before = {a: cluster.stats(a).prefix_cache_queries for a in (drained, other)}
    for n in range(4):
        client.completions.create(model=MODEL, prompt=f"new {n} " * 5, max_tokens=2)
    assert cluster.stats(drained).prefix_cache_queries == before[drained]
    assert cluster.stats(other).prefix_cache_queries > before[other]
    info = stub.ResumeInstance(admin_pb2.InstanceRef(name=name), metadata=auth)
    assert not info.drained


def test_scaling_adds_an_instance_that_receives_traffic(
    cluster: UpCluster, client: openai.OpenAI
) -> None:
    stub, token = admin_stub(cluster)
    auth = (("authorization", f"Bearer {token}"),)
    reply = stub.ScaleRole(admin_pb2.ScaleRoleRequest(role="prefill", replicas=3), metadata=auth)
    added = next(i for i in reply.instances if i.name == "prefill-2")
    assert added.alive and added.role == "prefill"
    http_sd = httpx.get(f"{cluster.router_url.removesuffix('/v1')}/prometheus/targets").json()
    assert [added.metrics_address] in [group["targets"] for group in http_sd]
    for name in ("prefill-0", "prefill-1"):  # only the new one can take requests now
        stub.DrainInstance(admin_pb2.InstanceRef(name=name), metadata=auth)
    try:
        client.completions.create(model=MODEL, prompt="for the new one", max_tokens=2)
    finally:
        for name in ("prefill-0", "prefill-1"):
            stub.ResumeInstance(admin_pb2.InstanceRef(name=name), metadata=auth)
    listed = stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=auth).instances
    assert next(i for i in listed if i.name == "prefill-2").stats.prefix_cache_queries > 0
    reply = stub.ScaleRole(admin_pb2.ScaleRoleRequest(role="prefill", replicas=2), metadata=auth)
    assert sorted(i.name for i in reply.instances if i.role == "prefill") == [
        "prefill-0",
        "prefill-1",
    ]


# -- fuzzing the OpenAPI document (schemathesis) -----------------------------------------------

FUZZ_EXAMPLES = 100  # per operation
# Every check but this one: cross-field limits the schema cannot state (prompt + max_tokens
# within the context window, token ids within the vocabulary, one of prompt/messages) turn a
# schema-valid request into a 400, rightly.
LIMITS_NOT_IN_THE_SCHEMA = [schemathesis.checks.positive_data_acceptance]


def test_fuzzed_requests_get_documented_answers_and_no_5xx(cluster: UpCluster) -> None:
    """Schemathesis' checks (no 5xx, documented status codes, content types and response
    schemas, invalid data rejected, ...) on cases generated from the router's /openapi.json."""
    base = cluster.router_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def check(case: schemathesis.Case) -> None:
            nonlocal cases
            cases += 1
            case.call_and_validate(timeout=120, excluded_checks=LIMITS_NOT_IN_THE_SCHEMA)

        check()
    print(f"schemathesis: {cases} cases")
    assert cases >= FUZZ_EXAMPLES * 4
    errors = {k: v for k, v in cluster.router_metrics().items()
              if k.startswith("pdserve_router_requests_total") and 'status="5' in k}  # fmt: skip
    assert not errors
