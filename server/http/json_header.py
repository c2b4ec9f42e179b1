"""A JSON inference request read header first: tensor `data` is parsed only when it is needed.

orjson turns a whole body into Python objects at once, so a 40 MB tensor costs hundreds of MB of
lists and numbers before any check sees that its shape is refused. `loads` finds the `data`
value of each `inputs` entry of a large body without parsing it (memchr and regular
expressions, at C speed), parses the rest (names, datatypes, shapes, parameters: the header)
with orjson, and hands back each input's data as `RawData`, parsed once the header is known
to fit the model: an array of numbers (flat or regularly nested) straight into C numbers by
simdjson (`RawData.numbers`), with no Python object per value (a Python float costs more than
parsing it), anything else by orjson.

The result is exactly `orjson.loads(body)` with those values deferred: the cut is checked, not
trusted. Each cut value is replaced by a per-request marker; the header must parse with every
marker where its data was found, or the whole body is parsed as before.
"""

from __future__ import annotations

import re
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import simdjson

from engine.datatypes import MAX_DIMS
from engine.errors import InvalidInput

LAZY_BYTES = 16 * 1024
"""Smaller bodies are parsed whole: the scan's fixed cost (~30 µs) would outweigh what reading
their numbers without Python objects (`RawData.numbers`) saves."""
PARSER_KEEPS_BYTES = 1024 * 1024
"""A thread keeps one simdjson parser for data up to this size (a new one costs its buffers'
allocation on every call); larger data gets a parser of its own, so no thread keeps the
buffers of the largest request it ever read."""
_PARSERS = threading.local()

NumberKind = Literal["d", "i", "u"]
"""C numbers `RawData.numbers` reads: double, int64, uint64."""

# One JSON token after optional whitespace: a string, a structural character, or a scalar.
_TOKEN = re.compile(rb'[ \t\n\r]*+(?:("(?:[^"\\]++|\\.)*+")|([\[\]{}:,])|[^ \t\n\r"\[\]{}:,]++)')
# The text of a value that holds no object: scalars, strings that are not keys, and brackets. In
# a valid body it ends with the value, its trailing comma and whitespace, at the next key or `}`.
_VALUE_TEXT = re.compile(rb'(?:[^"{}:]++|"(?:[^"\\]++|\\.)*+"(?![ \t\n\r]*+:))*+')
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_CHUNK_BYTES = 4 * 1024 * 1024  # each regex call holds the GIL; this bounds how long
_MAX_TOKENS = 20_000  # a header with more is unusual: parse the body whole instead
_MAX_CUTS = 1024
"""A body with more `data` values than this is parsed whole: a model has far fewer inputs, and
each cut costs Python steps (~2 µs, and a marker to parse) where orjson reads a small value in
nanoseconds (256 kB of `{"data":1},` took 110 ms on the event loop, 0.6 ms parsed whole)."""
_INPUTS, _DATA = b'"inputs"', b'"data"'
_COLON = re.compile(rb"[ \t\n\r]*+:")


@dataclass(frozen=True, slots=True)
class RawData:
    """An input's `data` value as it appears in the body, not yet parsed."""

    body: bytes
    start: int
    end: int

    def parse(self) -> Any:
        """The value, or InvalidInput with orjson's message, placed in the whole body."""
        try:
            return orjson.loads(memoryview(self.body)[self.start : self.end])
        except orjson.JSONDecodeError as exc:
            pos = self.start + exc.pos
            line = self.body.count(b"\n", 0, pos) + 1
            column = pos - self.body.rfind(b"\n", 0, pos)
            raise InvalidInput(
                f"request body is not valid JSON: {exc.msg}: line {line} column {column} "
                f"(char {pos})"
            ) from None

    def numbers(self, kind: NumberKind) -> bytes | None:
        """The value's numbers in row-major order as a buffer of C numbers of `kind` ("d":
        double, "i": int64, "u": uint64), read by simdjson without a Python object per value;
        None unless the value is an array of JSON numbers that each fit `kind`, flat or
        regularly nested (no ragged lists, lists mixed with values or nesting past MAX_DIMS;
        no bool, null, string or object, no fraction for an integer kind, no integer past 64
        bits, no text that is not JSON): `parse` then tells what it holds. simdjson reads a
        number as the nearest double, as orjson does, and an integer that a double holds
        inexactly as its nearest double, as Python's float() does."""
        size = self.end - self.start
        parser = getattr(_PARSERS, "parser", None) if size <= PARSER_KEEPS_BYTES else None
        if parser is None:
            parser = simdjson.Parser()
            if size <= PARSER_KEEPS_BYTES:
                _PARSERS.parser = parser
        try:
            return _regular_buffer(parser, self.body[self.start : self.end], kind)
        except (ValueError, TypeError, RuntimeError):  # not JSON, not such numbers, too large
            return None


def loads(body: bytes | memoryview) -> Any:
    """`orjson.loads(body)`, except that in a body of LAZY_BYTES or more each `inputs[i].data`
    value is a RawData. Raises orjson.JSONDecodeError for a malformed body, as orjson does."""
    if len(body) < LAZY_BYTES:
        return orjson.loads(body)
    text = bytes(body) if isinstance(body, memoryview) else body
    for find in (_data_keys, _data_values):
        cuts = find(text)
        header = _deferred(text, cuts) if cuts else None
        if header is not None:
            return header
    return orjson.loads(body)


def _deferred(text: bytes, cuts: list[tuple[int, int, int]]) -> Any:
    """The body parsed with each cut `data` value a RawData; None unless each cut is exactly the
    `data` value of the input it names."""
    marker = secrets.token_hex(8)
    pieces: list[bytes] = []
    start = 0
    for number, (_, begin, end) in enumerate(cuts):
        pieces += (text[start:begin], f'"{marker}:{number}"'.encode())
        start = end
    pieces.append(text[start:])
    try:
        header = orjson.loads(b"".join(pieces))
        inputs = header["inputs"]
        for number, (index, begin, end) in enumerate(cuts):
            if inputs[index]["data"] != f"{marker}:{number}":
                return None
            inputs[index]["data"] = RawData(text, begin, end)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None  # the cut was wrong, or the body is (orjson then says where)
    return header


def _data_keys(text: bytes) -> list[tuple[int, int, int]]:
    """The cuts of a body in the common layout, where each input has one `data` key, in order,
    and no other key is named "data": each `"data":` found by memchr, its value crossed as in
    the walk; cheaper than the walk (`_data_values`: a regex and a Python step per token of the
    header, 16 µs for the CNN's), which runs when these cuts are not the body's."""
    cuts: list[tuple[int, int, int]] = []
    nexts = _Next(text)
    pos = 0
    while (at := text.find(_DATA, pos)) >= 0:
        colon = _COLON.match(text, at + len(_DATA))
        pos = at + len(_DATA)
        if colon is None:
            continue
        begin, end = _value_span(text, colon.end(), nexts)
        if begin == end or len(cuts) == _MAX_CUTS:
            return []
        cuts.append((len(cuts), begin, end))
        pos = end
    return cuts


def _regular_buffer(parser: simdjson.Parser, text: bytes, kind: NumberKind) -> bytes | None:
    """as_buffer of the array `text` holds, if its lists nest regularly; no proxy into the
    parser outlives this call (the parser refuses to parse again while one does).

    as_buffer flattens any nesting, ragged too, so the lists are checked a level at a time
    (a Python step per list, none per value): every list at one depth holds lists, all of one
    length, or none does; and `[` occurs in the text once per list seen, so no list hides among
    the last level's values (a string holding `[` is refused by as_buffer anyway)."""
    value = parser.parse(text)
    if not isinstance(value, simdjson.Array):
        return None
    lists, level = 1, [value]
    for _ in range(MAX_DIMS):
        if not len(level[0]) or not isinstance(level[0][0], simdjson.Array):
            break
        items = [item for array in level for item in array]
        inner = [item for item in items if isinstance(item, simdjson.Array)]
        if len(inner) != len(items) or len({len(item) for item in inner}) != 1:
            return None
        lists, level = lists + len(inner), inner
    else:
        return None  # deeper than any shape: the walk names it
    return value.as_buffer(of_type=kind) if _brackets(text, lists) else None


def _brackets(text: bytes, lists: int) -> bool:
    """Whether `[` occurs in `text` exactly `lists` times. Flat data (one list, the common case)
    asks for a second `[` by memchr: 1 µs for the CNN's 91 kB, where counting them takes 23."""
    if lists == 1:
        return text.find(b"[", text.find(b"[") + 1) < 0
    return text.count(b"[") == lists


def _data_values(text: bytes) -> list[tuple[int, int, int]]:
    """(input index, start, end) of each `data` value of the top-level `inputs` array, found by
    walking the structure token by token and jumping over data values; [] when unsure."""
    cuts: list[tuple[int, int, int]] = []
    nexts = _Next(text)
    stack: list[tuple[bytes, bytes | None]] = []  # open containers: kind and the key they are at
    key: bytes | None = None
    after_colon = False
    index = -1
    pos = 0
    for _ in range(_MAX_TOKENS):
        match = _TOKEN.match(text, pos)
        if match is None:
            return []
        pos = match.end()
        string, punct = match.group(1), match.group(2)
        in_inputs = len(stack) == 2 and stack[1] == (b"[", _INPUTS)
        if punct in (b"{", b"["):
            index += in_inputs
            stack.append((punct, key if after_colon else None))
            key, after_colon = None, False
        elif punct in (b"}", b"]"):
            if not stack:
                return []
            stack.pop()
            key, after_colon = None, False
            if not stack:
                return cuts
        elif punct == b",":
            key, after_colon = None, False
        elif punct == b":":
            after_colon = True
            if key == _DATA and len(stack) == 3 and stack[1] == (b"[", _INPUTS):
                begin, end = _value_span(text, pos, nexts)
                if begin == end or len(cuts) == _MAX_CUTS:
                    return []
                cuts.append((index, begin, end))
                pos, key, after_colon = end, None, False
        elif string is not None and stack and stack[-1][0] == b"{" and not after_colon:
            key = string
        else:  # a scalar or string value
            index += in_inputs
            after_colon = False
    return []


def _value_span(text: bytes, pos: int, nexts: _Next) -> tuple[int, int]:
    """Start and end of the object-free value at `pos` (empty when it is not one).

    Runs without strings (numbers, the common case) are crossed with bytes.find, at memchr
    speed; a run of string values is crossed by the _VALUE_TEXT regex, a chunk at a time."""
    size = len(text)
    while pos < size and text[pos] in b" \t\n\r":
        pos += 1
    end = pos
    while end < size:
        quote = nexts(b'"', end)
        # The next `{`, `}` or `:`: one inside a string is passed over by the regex below, and
        # looked for again past it.
        stop = min(quote, nexts(b"{", end), nexts(b"}", end), nexts(b":", end))
        if stop != quote or stop == size:  # a `{`, `}` or `:` ends the value's text here
            end = stop
            break
        run = _VALUE_TEXT.match(text, stop, min(stop + _CHUNK_BYTES, size))
        found = stop if run is None else run.end()
        if found == stop:  # a key, or a string value longer than the chunk
            string = _STRING.match(text, stop)
            if string is None or re.match(rb"[ \t\n\r]*+:", text[string.end() : string.end() + 64]):
                end = stop
                break
            found = string.end()
        end = found
    while end > pos and text[end - 1] in b" \t\n\r,":
        end -= 1
    return pos, end


class _Next:
    """Where each byte next occurs in `text` at or past a position, by memchr, remembered: a
    walk asks at growing positions, so each byte's scan crosses the text once, not once per
    value (thousands of small data values before a long string scanned the string each)."""

    __slots__ = ("_at", "_text")

    def __init__(self, text: bytes) -> None:
        self._text = text
        self._at: dict[bytes, int] = {}

    def __call__(self, char: bytes, pos: int) -> int:
        at = self._at.get(char, -1)
        if at < pos:
            at = self._at[char] = _find(self._text, char, pos)
        return at


def _find(text: bytes, char: bytes, start: int) -> int:
    at = text.find(char, start)
    return len(text) if at < 0 else at
