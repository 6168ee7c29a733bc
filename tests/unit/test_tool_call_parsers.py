"""Tool-call parsers on answers in the formats real models write (Qwen 2.5 / Hermes 2 Pro's
`<tool_call>` blocks, Llama 3.1's JSON), whole and streamed in arbitrary pieces; the
`required` grammar's output, sampled with xgrammar on the tiny vocabulary, parses into calls
whose arguments validate against their tools' schemas."""

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.config import TOOL_PARSERS
from pdserve.engine.grammar import Grammars, apply_masks
from pdserve.errors import InvalidRequestError
from pdserve.model.tiny import CHAT_TEMPLATE
from pdserve.model.tokenizer import Tokenizer
from services.router import tool_calls
from services.router.tool_calls import (
    CallParser,
    HermesCalls,
    Llama3JsonCalls,
    NamedCall,
    RequiredCalls,
    assemble,
    stream_delta,
)

NAMES = frozenset({"get_current_weather", "get_time"})
WEATHER = {"location": "San Francisco, CA", "unit": "fahrenheit"}

# Answers as the models write them (the format each model's chat template asks for).
HERMES_ANSWERS: list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (  # Qwen2.5-Instruct: one call, newline-padded inside the block
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
        '"San Francisco, CA", "unit": "fahrenheit"}}\n</tool_call>',
        None,
        [("get_current_weather", WEATHER)],
    ),
    (  # parallel calls, one block each
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
        "</tool_call>",
        None,
        [("get_current_weather", {"location": "Paris"}), ("get_time", {"zone": "CET"})],
    ),
    (  # Hermes 2 Pro: a sentence first
        "Let me look that up.\n<tool_call>\n"
        '{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>',
        "Let me look that up.\n",
        [("get_time", {"zone": "UTC"})],
    ),
    ("It is 21 °C and sunny in Paris.", "It is 21 °C and sunny in Paris.", []),
    (  # the model stopped at EOS before closing the block
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "JST"}}',
        None,
        [("get_time", {"zone": "JST"})],
    ),
    (  # not a function it was offered: kept as text
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        [],
    ),
    (  # broken JSON: kept as text
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": }\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": }\n</tool_call>',
        [],
    ),
    ("a < b, and <tool is not a tag", "a < b, and <tool is not a tag", []),
]

LLAMA3_ANSWERS: list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (  # Llama 3.1-Instruct, JSON-based tool calling
        '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", '
        '"unit": "fahrenheit"}}',
        None,
        [("get_current_weather", WEATHER)],
    ),
    (  # after the <|python_tag|> special token, when it is kept in the text
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
        None,
        [("get_time", {"zone": "UTC"})],
    ),
    (  # Llama 3.2's parallel calls joined by "; "
        '{"name": "get_time", "parameters": {"zone": "UTC"}}; '
        '{"name": "get_current_weather", "parameters": {"location": "Oslo"}}',
        None,
        [("get_time", {"zone": "UTC"}), ("get_current_weather", {"location": "Oslo"})],
    ),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    ('{"name": "get_time", "parameters": {"zone": ',  # cut by the length limit
     '{"name": "get_time", "parameters": {"zone": ', []),
]  # fmt: skip


def _run(parser: CallParser, pieces_of_text: list[str]) -> tuple[str | None, list[Any], str]:
    pieces = [p for text in pieces_of_text for p in parser.feed(text)] + parser.finish()
    content, calls = assemble(pieces)
    parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return content, parsed, parser.finish_reason("stop")


def _splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(
    ("parser", "answers"),
    [(HermesCalls, HERMES_ANSWERS), (Llama3JsonCalls, LLAMA3_ANSWERS)],
)
def test_recorded_answers_parse_the_same_whole_streamed_and_char_by_char(
    parser: Callable[[frozenset[str]], CallParser],
    answers: list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]],
) -> None:
    for text, content, calls in answers:
        expected = (content, calls, "tool_calls" if calls else "stop")
        assert _run(parser(NAMES), [text]) == expected, text
        assert _run(parser(NAMES), list(text)) == expected, text
        for seed in range(5):
            assert _run(parser(NAMES), _splits(text, seed)) == expected, (text, seed)


def test_hermes_streams_text_at_once_and_holds_back_only_a_possible_tag() -> None:
    parser = HermesCalls(NAMES)
    assert stream_delta(parser.feed("Checking")) == {"content": "Checking"}
    assert stream_delta(parser.feed(" now <tool_")) == {"content": " now "}  # "<tool_" held
    assert stream_delta(parser.feed('call>{"name": "get_time", ')) == {}
    delta = stream_delta(parser.feed('"arguments": {}}</tool_call>'))
    (call,) = delta["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    assert stream_delta(parser.feed("\n")) == {}  # whitespace after a call is not content
    assert parser.finish() == []


def test_required_arguments_stream_as_they_arrive_and_keep_their_text() -> None:
    answer = (
        '[{"name": "get_time", "parameters": {"zone": "a \\"}]\\\\ b", "n": [1, {"x": 2}]}}, '
        '{"name": "get_current_weather", "parameters": {}}]'
    )
    parser = RequiredCalls(NAMES)
    deltas = [stream_delta(parser.feed(char)) for char in answer]
    first = next(d for d in deltas if d)
    assert first["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    arguments: dict[int, str] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", ()):
            arguments[entry["index"]] = (
                arguments.get(entry["index"], "") + entry["function"]["arguments"]
            )
    assert arguments == {0: '{"zone": "a \\"}]\\\\ b", "n": [1, {"x": 2}]}', 1: "{}"}
    assert _run(RequiredCalls(NAMES), [answer])[1] == [
        ("get_time", {"zone": 'a "}]\\ b', "n": [1, {"x": 2}]}),
        ("get_current_weather", {}),
    ]


def test_a_required_call_cut_before_its_arguments_is_kept_as_text() -> None:
    content, calls, reason = _run(RequiredCalls(NAMES), ['[{"name": "get_time"}, {"name": "g'])
    assert (content, calls, reason) == ('{"name": "get_time"}, {"name": "g', [], "stop")
    done = '[{"name": "get_time", "parameters": {}}]'
    assert _run(RequiredCalls(NAMES), [done + "\n"]) == (None, [("get_time", {})], "tool_calls")


def test_named_call_is_the_whole_output_and_finishes_with_stop() -> None:
    assert _run(NamedCall("get_time"), ['{"zone"', ': "UTC"}']) == (
        None,
        [("get_time", {"zone": "UTC"})],
        "stop",
    )
    empty = NamedCall("get_time")
    content, calls = assemble(empty.finish())
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": ""}


def test_a_call_cut_by_the_length_limit_keeps_its_finish_reason() -> None:
    parser = HermesCalls(NAMES)
    parser.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert parser.finish_reason("length") == "length"


def test_the_family_comes_from_the_chat_template() -> None:
    qwen = '{%- if tools %}…<tools>{{ tool | tojson }}</tools>…<tool_call>\\n{"name": …'
    llama = '{%- if builtin_tools is defined %}…<|python_tag|>…{"name": function name, …'
    assert tool_calls.family_of(qwen) == "hermes"
    assert tool_calls.family_of(llama) == "llama3_json"
    assert tool_calls.family_of(CHAT_TEMPLATE) == "hermes"  # the tiny model's
    assert tool_calls.family_of("{{ messages }}") is None
    assert set(tool_calls.PARSERS) == set(TOOL_PARSERS)
    with pytest.raises(InvalidRequestError, match=r"router\.tool_parser"):
        tool_calls.parser_factory("auto", NAMES, None, None)


TOOLS = [
    ("get_current_weather", {
        "type": "object",
        "properties": {"location": {"type": "string", "pattern": "^[A-Za-z ,]{1,12}$"},
                       "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
        "required": ["location", "unit"], "additionalProperties": False,
    }),
    ("get_time", {"type": "object",
                  "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{2,5}$"}},
                  "required": ["zone"], "additionalProperties": False}),
]  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**30), single=st.booleans())
def test_the_required_grammar_only_allows_calls_that_parse_and_validate(
    grammars: Grammars, tokenizer: Tokenizer, seed: int, single: bool
) -> None:
    schema = tool_calls.required_schema(TOOLS, single)
    matcher = grammars.matcher("json_schema", json.dumps(schema))
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not matcher.is_terminated() and len(out) < 400:
        logits = torch.randn(1, tokenizer.vocab_size, generator=generator)
        apply_masks(logits, [matcher])
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        out.append(token)
    if not matcher.is_terminated():
        return  # a random walk through a long string: nothing to parse
    text = tokenizer.decode(out[:-1])  # the last is the stop token
    content, calls, reason = _run(RequiredCalls(NAMES), [text])
    assert content is None and reason == "tool_calls" and calls
    assert len(calls) == 1 or not single
    for name, arguments in calls:
        jsonschema.validate(arguments, dict(TOOLS)[name])


def test_a_length_bounded_json_string_takes_no_raw_control_character(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """xgrammar lets one in (see pdserve.engine.grammar); JSON parsers refuse it."""
    for bound in ({"maxLength": 12}, {"minLength": 1}, {}):
        schema = {"type": "object", "properties": {"a": {"type": "string", **bound}}}
        matcher = grammars.matcher("json_schema", json.dumps(schema))
        for token in tokenizer.encode('{"a": "x', add_special_tokens=False):
            assert matcher.accept_token(token)
        (control,) = tokenizer.encode("\x1f", add_special_tokens=False)
        assert not matcher.accept_token(control), bound
        (letter,) = tokenizer.encode("y", add_special_tokens=False)
        assert matcher.accept_token(letter)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    eos = tokenizer.eos_token_id
    assert eos is not None
    return Grammars(tokenizer, tokenizer.vocab_size, [eos])
