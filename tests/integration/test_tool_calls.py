"""Tool calls through the router with the official `openai` SDK, over real PD instances and a
mixed one: `required` and a named function are enforced by the grammar (every call parses and
validates, streamed or not), `auto` parses the model's own `<tool_call>` blocks (the tiny
model's chat template is Hermes-style; a guided regex makes the random model write one),
`none` ignores the tools, and what cannot be honoured is a 400."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from stacks import Stack, pd_stack

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"], "additionalProperties": False}  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: Any = [
    {"type": "function", "function": {"name": name, "description": f"{name} somewhere",
                                      "parameters": schema}}
    for name, schema in SCHEMAS.items()
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def routers(tiny_model_dir: Path) -> Iterator[tuple[Stack, Stack]]:
    """(a PD stack, a mixed stack) over the same model."""
    engine = {"num_kv_blocks": 256}
    with (
        pd_stack(tiny_model_dir, engine=engine) as pd,
        pd_stack(tiny_model_dir, mixed=1, engine=engine) as mixed,
    ):
        yield pd, mixed


@pytest.fixture(scope="module")
def client(routers: tuple[Stack, Stack]) -> Iterator[openai.OpenAI]:
    api = openai.OpenAI(base_url=f"{routers[0].url}/v1", api_key="unused", max_retries=0)
    yield api
    api.close()


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_required_calls_parse_and_validate_against_their_tools(client: openai.OpenAI) -> None:
    for seed in range(6):
        single = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,  # type: ignore[arg-type]
            temperature=1.0, max_tokens=200, parallel_tool_calls=False,
        )  # fmt: skip
        choice = single.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (name, arguments), = _calls(choice.message)  # fmt: skip
        jsonschema.validate(arguments, SCHEMAS[name])
        assert (choice.message.tool_calls or [])[0].id.startswith("call_")
    parallel = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=0,  # type: ignore[arg-type]
        temperature=1.0, max_tokens=400, n=4,
    )  # fmt: skip
    for choice in parallel.choices:  # the random model decides how many calls to make
        calls = choice.message.tool_calls or []
        done = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # cut by length
        for call in done:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert len({call.id for call in calls}) == len(calls)
    assert any(len(c.message.tool_calls or []) > 1 for c in parallel.choices)


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    choice_of = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice_of, seed=seed,  # type: ignore[arg-type]
            temperature=1.0, max_tokens=100,
        )  # fmt: skip
        (name, arguments), = _calls(reply.choices[0].message)  # fmt: skip
        assert name == "get_time" and reply.choices[0].finish_reason == "stop"
        jsonschema.validate(arguments, TIME)


def test_streamed_tool_calls_assemble_to_the_unstreamed_ones(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                seed=0, temperature=1.0, max_tokens=400)  # fmt: skip
    whole = client.chat.completions.create(**args)
    deltas = []
    with client.chat.completions.stream(**args) as stream:  # the SDK's own accumulation
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                deltas += event.chunk.choices[0].delta.tool_calls or []
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == _calls(whole.choices[0].message)
    assert final.choices[0].finish_reason == "tool_calls"
    starts = [d for d in deltas if d.id is not None]
    assert len(starts) == len(_calls(whole.choices[0].message))
    assert all(d.function and d.function.name for d in starts)
    assert len(deltas) > 2 * len(starts)  # arguments arrive in pieces, as they are generated


def test_auto_parses_the_calls_the_model_writes(client: openai.OpenAI) -> None:
    written = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    args: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=2,
                                max_tokens=80, extra_body={"guided_regex": written})  # fmt: skip
    reply = client.chat.completions.create(**args)
    (name, arguments), = _calls(reply.choices[0].message)  # fmt: skip
    assert name == "get_time" and arguments["zone"] in ("UTC", "CET")
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None
    with client.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == [(name, arguments)]
    plain = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           max_tokens=12, temperature=0)  # fmt: skip
    assert plain.choices[0].message.tool_calls is None  # the random model wrote no call
    assert plain.choices[0].message.content and plain.choices[0].finish_reason == "length"


def test_none_ignores_the_tools_and_auto_shows_them_to_the_model(client: openai.OpenAI) -> None:
    def ask(**extra: Any) -> Any:
        return client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=8, temperature=0, **extra
        )

    bare, ignored, offered = ask(), ask(tools=TOOLS, tool_choice="none"), ask(tools=TOOLS)
    assert ignored.choices[0].message.content == bare.choices[0].message.content
    assert ignored.usage.prompt_tokens == bare.usage.prompt_tokens
    assert offered.usage.prompt_tokens > bare.usage.prompt_tokens + 100  # the tools' schemas


def test_a_conversation_carries_its_calls_and_results_back(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        seed=0,
        max_tokens=200,  # type: ignore[arg-type]
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history: Any = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]  # fmt: skip
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert second.usage and first.usage
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result


def test_pd_and_mixed_make_the_same_greedy_call(
    routers: tuple[Stack, Stack],
) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "temperature": 0, "max_tokens": 120}  # fmt: skip
    pd, mixed = (httpx.post(f"{r.url}/v1/chat/completions", json=body, timeout=60) for r in routers)
    pd_calls = [c["function"] for c in pd.json()["choices"][0]["message"]["tool_calls"]]
    mixed_calls = [c["function"] for c in mixed.json()["choices"][0]["message"]["tool_calls"]]
    assert pd_calls == mixed_calls and pd_calls


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS * 2}, "same name"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         "not JSON"),
    ],
)  # fmt: skip
def test_tools_the_server_cannot_honour_get_400(
    routers: tuple[Stack, Stack], extra: dict[str, Any], fragment: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, **extra}
    reply = httpx.post(f"{routers[0].url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert fragment in reply.json()["error"]["message"]
