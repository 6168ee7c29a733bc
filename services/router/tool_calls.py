"""Tool calls: what a chat answer means as OpenAI `tool_calls`.

`tool_choice: "required"` or a named function constrains the output with a grammar built from
the tools' JSON schemas (`grammar`): a JSON array of `{"name", "parameters"}` objects, or the
named function's arguments. `"auto"` lets the model answer freely and a parser of its family's
format finds the calls: `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`: Qwen 2.5/3,
Hermes) or `llama3_json` (a bare `{"name", "parameters"}` object, several joined by `;`: Llama
3.1–3.3). The family comes from `router.tool_parser`, else from the chat template (`family_of`).

Every parser turns text, as it streams, into pieces (`Content`, `CallStart`, `CallArguments`);
a whole response is the same pieces assembled (`assemble`), a stream sends them as deltas
(`stream_delta`), so both come from one code path.
"""

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.choices import ToolParserName, registry
from pdserve.errors import InvalidRequestError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str


Piece = Content | CallStart | CallArguments


def family_of(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model; None when it teaches none."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return ToolParserName.HERMES
    if PYTHON_TAG in template or ("ipython" in template and "parameters" in template):
        return ToolParserName.LLAMA3_JSON
    return None


def required_schema(tools: Sequence[tuple[str, dict[str, Any]]], single: bool) -> dict[str, Any]:
    """`tool_choice: "required"`: one or more calls of the given (name, parameters schema)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
        }
        for name, parameters in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if single:  # parallel_tool_calls: false
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallParser:
    """Streamed text in, pieces out. `reports_calls`: a finish by stop becomes
    `finish_reason: "tool_calls"` once a call was made (not for a named function, as OpenAI)."""

    reports_calls = True

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        return []

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" and self.reports_calls else reason

    def _call(self, name: str, arguments: str | None = None) -> list[Piece]:
        index = self.calls
        self.calls += 1
        start: list[Piece] = [CallStart(index, new_call_id(), name)]
        return start + ([CallArguments(index, arguments)] if arguments else [])

    def _content(self, text: str) -> list[Piece]:
        """Text outside calls; whitespace between or after calls is dropped."""
        return [Content(text)] if text and not (self.calls and not text.strip()) else []


class NamedCall(CallParser):
    """A named function: the whole output is its arguments (the grammar made it so)."""

    reports_calls = False

    def __init__(self, name: str) -> None:
        super().__init__(frozenset({name}))
        self._name = name

    def feed(self, text: str) -> list[Piece]:
        if not self.calls:
            return self._call(self._name, text)
        return [CallArguments(0, text)] if text else []

    def finish(self) -> list[Piece]:
        return [] if self.calls else self._call(self._name)


_REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


class RequiredCalls(CallParser):
    """`tool_choice: "required"`: the grammar's `[{"name": …, "parameters": …}, …]`, with each
    call's arguments streamed as their text arrives."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self._text = ""
        self._at = 0
        self._state = "between"  # between | head | value | arguments
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        pieces: list[Piece] = []
        while self._at < len(self._text):
            if self._state == "between":
                char = self._text[self._at]
                if char == "{":
                    self._state = "head"
                elif char in " \n\t[,]}":
                    self._at += 1
                else:
                    return pieces  # not the grammar's shape: nothing more is a call
            elif self._state == "head":
                head = _REQUIRED_HEAD.match(self._text, self._at)
                if head is None:
                    return pieces  # the head is not complete yet
                pieces += self._call(json.loads(head.group(1)))
                self._at, self._state = head.end(), "value"
            elif self._state == "value":  # whitespace before the arguments is not theirs
                if self._text[self._at] in " \n\t":
                    self._at += 1
                else:
                    self._state = "arguments"
            else:
                pieces += self._arguments()
        return pieces

    def finish(self) -> list[Piece]:
        """What never became a call (a head cut by the length limit) is kept as text."""
        rest = self._text[self._at :] if self._state in ("between", "head") else ""
        return [Content(rest)] if rest.strip(" \n\t]}") else []

    def _arguments(self) -> list[Piece]:
        """Scan the current call's arguments value up to its end (or the text's)."""
        start = self._at
        while self._at < len(self._text):
            char = self._text[self._at]
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = char == "\\"
                self._in_string = char != '"'
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif self._depth == 0 and char in ",}]":
                self._state = "between"
                break
            elif char in "}]":
                self._depth -= 1
            self._at += 1
        text = self._text[start : self._at]
        return [CallArguments(self.calls - 1, text)] if text else []


class HermesCalls(CallParser):
    """`<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks among free text."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            marker = HERMES_CLOSE if self._inside else HERMES_OPEN
            found = self._buffer.find(marker)
            if found < 0:
                break
            before, self._buffer = self._buffer[:found], self._buffer[found + len(marker) :]
            pieces += self._block(before) if self._inside else self._content(before)
            self._inside = not self._inside
        if not self._inside:  # hold back what may be the start of a marker
            held = _partial_suffix(self._buffer, HERMES_OPEN)
            pieces += self._content(self._buffer[: len(self._buffer) - held])
            self._buffer = self._buffer[len(self._buffer) - held :]
        return pieces

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        return self._block(rest, closed=False) if self._inside else self._content(rest)

    def _block(self, block: str, closed: bool = True) -> list[Piece]:
        call = _call_object(block.strip(), self.names, "arguments")
        if call is None:  # not a call of a declared tool: keep the text
            return self._content(HERMES_OPEN + block + (HERMES_CLOSE if closed else ""))
        return self._call(*call)


class Llama3JsonCalls(CallParser):
    """Llama 3's JSON tool calls: the answer is `{"name": …, "parameters": {…}}` (optionally
    after `<|python_tag|>`, several joined by `;`), or it is plain text."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self._buffer = ""
        self._mode: str | None = None  # None until the first character decides: json | text
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []
            self._mode = "json" if head.startswith(("{", PYTHON_TAG)) else "text"
        if self._mode == "text":
            text, self._buffer = self._buffer, ""
            return self._content(text)
        return self._objects()

    def _objects(self) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            rest = self._buffer.lstrip().removeprefix(PYTHON_TAG).lstrip(" \n\t;")
            try:
                value, end = self._decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return pieces  # incomplete (or not JSON: `finish` keeps it as text)
            call = _call_object(value, self.names, "parameters")
            if call is None:  # JSON, but not a call: the whole answer is text
                self._mode = "text"
                return pieces + self.feed("")
            pieces += self._call(*call)
            self._buffer = rest[end:]

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        return self._content(rest if rest.strip() else "")


def _call_object(value: Any, names: frozenset[str], key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed or textual call object; None if it is not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models quote the arguments object
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return str(value["name"]), json.dumps(arguments, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


# `tool_choice: "auto"` parsers by family, keyed by pdserve.choices.ToolParserName (the list
# `router.tool_parser` is checked against)
PARSERS: dict[str, type[CallParser]] = registry(
    ToolParserName,
    {ToolParserName.HERMES: HermesCalls, ToolParserName.LLAMA3_JSON: Llama3JsonCalls},
)


def parser_factory(
    mode: str, names: frozenset[str], family: str | None, named: str | None
) -> Callable[[], CallParser]:
    """A new parser per choice, for a tool_choice `mode` of auto, required or named."""
    if mode == "named" and named is not None:
        return lambda: NamedCall(named)
    if mode == "required":
        return lambda: RequiredCalls(names)
    if family not in PARSERS:
        raise InvalidRequestError(
            'tool_choice "auto": this model\'s chat template teaches no tool-call format '
            f"pdserve can parse; set router.tool_parser ({' | '.join(PARSERS)}), or use "
            'tool_choice "required" or a named function'
        )
    parser = PARSERS[family]
    return lambda: parser(names)


def assemble(pieces: Sequence[Piece]) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer: its content (None when there are calls and no text) and its calls."""
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if isinstance(piece, CallStart):
            function = {"name": piece.name, "arguments": ""}
            calls[piece.index] = {"id": piece.call_id, "type": "function", "function": function}
        elif isinstance(piece, CallArguments):
            calls[piece.index]["function"]["arguments"] += piece.text
    return (content or None) if calls else content, list(calls.values())


def stream_delta(pieces: Sequence[Piece]) -> dict[str, Any]:
    """One chunk's `delta`: its text as `content`, its calls as OpenAI's tool-call deltas (the
    first of a call carries id, type and name; later ones add to `arguments`)."""
    delta: dict[str, Any] = {}
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    if content:
        delta["content"] = content
    entries: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if isinstance(piece, CallStart):
            function = {"name": piece.name, "arguments": ""}
            entries[piece.index] = {"index": piece.index, "id": piece.call_id,
                                    "type": "function", "function": function}  # fmt: skip
        elif isinstance(piece, CallArguments):
            entry = entries.setdefault(
                piece.index, {"index": piece.index, "function": {"arguments": ""}}
            )
            entry["function"]["arguments"] += piece.text
    if entries:
        delta["tool_calls"] = list(entries.values())
    return delta
