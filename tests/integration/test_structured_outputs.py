"""Structured outputs through the router over real PD instances (prefill masks the first
token, decode the rest): JSON schema, JSON object, regex and choice, with the random tiny
model; a grammar that does not compile is a 400."""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from stacks import Stack, pd_stack

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "large"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path) -> Iterator[Stack]:
    with pd_stack(tiny_model_dir, engine={"num_kv_blocks": 256}) as stack:
        yield stack


def test_twenty_json_schema_answers_all_parse_and_validate(router: Stack) -> None:
    api = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    for n in range(20):
        reply = api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"describe thing {n}"}],
            max_tokens=120, temperature=1.0, seed=n, response_format=response_format,  # type: ignore[arg-type]
        )  # fmt: skip
        text = reply.choices[0].message.content or ""
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reply.choices[0].finish_reason == "stop"
    api.close()


def test_json_object_regex_and_choice_are_enforced(router: Stack) -> None:
    url = f"{router.url}/v1/completions"
    base = {"model": "tiny", "prompt": "Answer:", "max_tokens": 40, "temperature": 1.0, "seed": 3}
    regex = httpx.post(url, json={**base, "guided_regex": "[a-c]{3}-[0-9]{2}"}, timeout=60)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", regex.json()["choices"][0]["text"])
    choice = httpx.post(url, json={**base, "guided_choice": ["red", "green"]}, timeout=60)
    assert choice.json()["choices"][0]["text"] in ("red", "green")
    as_object = {**base, "max_tokens": 200, "response_format": {"type": "json_object"}}
    obj = httpx.post(url, json=as_object, timeout=60).json()
    text, reason = obj["choices"][0]["text"], obj["choices"][0]["finish_reason"]
    assert text.lstrip().startswith("{")  # JSON from the first token on ...
    if reason == "stop":
        assert isinstance(json.loads(text), dict)  # ... and whole when it ended by itself
    schema_format = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    body = {**base, "stream": True, "max_tokens": 120, "response_format": schema_format}
    with httpx.stream("POST", url, json=body, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_a_grammar_that_does_not_compile_is_a_400(router: Stack) -> None:
    url = f"{router.url}/v1/completions"
    bad = httpx.post(url, json={"model": "tiny", "prompt": "x", "guided_regex": "(unclosed"})
    assert bad.status_code == 400 and "does not compile" in bad.json()["error"]["message"]
    both = httpx.post(url, json={"model": "tiny", "prompt": "x", "guided_regex": "a",
                                 "guided_choice": ["b"]})  # fmt: skip
    assert both.status_code == 400
    wrong = httpx.post(url, json={"model": "tiny", "prompt": "x",
                                  "response_format": {"type": "yaml"}})  # fmt: skip
    assert wrong.status_code == 400
