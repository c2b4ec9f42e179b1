"""OpenAI's structured output and tools as guided decoding: `response_format` and
`tools`/`tool_choice` become the grammar the engine guides the output by (an option
`guidance`: [kind, grammar], engine/generation/sampling.py), and the answer is read back
into `tool_calls`. The engine knows nothing of OpenAI; this module knows nothing of the engine.

A tool call is the JSON object `{"name": <a tool's name>, "arguments": <its parameters>}`
(the form Hermes- and Qwen-style templates teach), compact. Under `tool_choice` `required` or
a named function the whole answer is one such call; under `auto` the answer is either a call
(it begins with `{`) or text (any other first character), the model choosing with its first
token. One call per answer (`parallel_tool_calls` is taken and has no effect).

JSON is guided without free whitespace between tokens (llguidance's `whitespace_flexible`
off, unless the schema sets `x-guidance` itself): a model, a small one above all, could
otherwise spend its whole budget on blank space inside a valid object."""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from engine.errors import InvalidInput
from server.fields import refused

MAX_TOOLS = 128
_COMPACT = {"whitespace_flexible": False}


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return schema if "x-guidance" in schema else {**schema, "x-guidance": _COMPACT}


def response_guidance(body: dict[str, Any]) -> list[str] | None:
    """The guidance `response_format` asks for: None for text (or none given); json_object
    guides to any JSON object, json_schema to its `schema` (strict or not: guided output
    always matches it)."""
    form = body.get("response_format")
    if form is None or form == {"type": "text"}:
        return None
    kinds = "an object with type text, json_object or json_schema"
    if not isinstance(form, dict):
        raise refused("response_format", kinds, form)
    if form.get("type") == "json_object":
        return ["json_schema", orjson.dumps(_compact({"type": "object"})).decode()]
    if form.get("type") != "json_schema":
        raise refused("response_format.type", "text, json_object or json_schema", form.get("type"))
    spec = form.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise refused("response_format.json_schema", "an object with a name and a schema", spec)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise refused("response_format.json_schema.schema", "a JSON schema object", schema)
    return ["json_schema", orjson.dumps(_compact(schema)).decode()]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of the answer: `tools` for the chat template, `mode` auto
    or required (a named function is `required` with `tools` narrowed to it in the grammar)
    and the guidance."""

    tools: list[dict[str, Any]]
    names: frozenset[str]
    mode: str
    guidance: list[str]

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer as OpenAI's `tool_calls`, or None when it is text (under auto) or not a
        whole call (cut short by max_tokens)."""
        if not text.startswith("{"):
            return None
        try:  # the standard library's: JSON allows numbers past a double (1E999), orjson not
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.names:
            return None
        # The arguments as generated: re-encoding would turn 1E999 into Infinity, not JSON.
        head = f'{{"name":{json.dumps(call["name"])},"arguments":'
        if text.startswith(head) and text.endswith("}"):
            arguments = text[len(head) : -1]
        else:
            arguments = json.dumps(call.get("arguments", {}), separators=(",", ":"))
        return [
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        ]


def _functions(tools: object) -> dict[str, dict[str, Any]]:
    """Each tool's name -> its parameters' schema, checked."""
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise refused("tools", f"a list of 1 to {MAX_TOOLS} function tools", tools)
    found: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not (isinstance(function, dict) and isinstance(function.get("name"), str))
        ):
            raise refused(f"tools[{index}]", "{type: function, function: {name, parameters}}", tool)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise refused(f"tools[{index}].function.parameters", "a JSON schema object", parameters)
        found[function["name"]] = parameters
    return found


def tool_plan(body: dict[str, Any]) -> ToolPlan | None:
    """The plan of a chat's `tools` and `tool_choice`, or None when no call may be made
    (no tools, or tool_choice none: the template still gets the tools then, through
    `template_tools`)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidInput("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    functions = _functions(tools)
    if choice == "none":
        return None
    if choice in (None, "auto", "required"):
        mode, chosen = choice or "auto", functions
    else:
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function"):
            raise refused(
                "tool_choice", "none, auto, required or {type: function, function: {name}}", choice
            )
        if name not in functions:
            raise refused("tool_choice.function.name", "one of the tools' names", name)
        mode, chosen = "required", {name: functions[name]}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in chosen.items()
    ]
    call = orjson.dumps(_compact({"anyOf": calls})).decode()
    if mode == "required":
        guidance = ["json_schema", call]
    else:  # the first character decides: `{` a call, anything else (or nothing) text
        guidance = [
            "lark_grammar",
            f"start: call | text\ncall: %json {call}\ntext: /([^{{](.|\\n)*)?/\n",
        ]
    return ToolPlan(list(tools), frozenset(chosen), mode, guidance)


def template_tools(body: dict[str, Any]) -> list[Any] | None:
    """The tools the chat template renders (OpenAI's list, as transformers passes it)."""
    tools = body.get("tools")
    return tools if isinstance(tools, list) and tools else None


def history_message(index: int, message: dict[str, Any]) -> dict[str, Any] | None:
    """An assistant message that made tool calls (content null or absent), made ready for the
    chat template: content "" and each call's arguments as an object when they parse (as
    transformers' templates expect them). None for any other message."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or calls is None:
        return None
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise refused(where, "a list of {id, type: function, function: {name, arguments}}", calls)
    ready = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise refused(
                f"{where}[{number}]", "{id, type: function, function: {name, arguments}}", call
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            with contextlib.suppress(orjson.JSONDecodeError):  # else shown as it came
                arguments = orjson.loads(arguments)
        ready.append({**call, "function": {**function, "arguments": arguments}})
    content = message.get("content")
    return {**message, "content": "" if content is None else content, "tool_calls": ready}
