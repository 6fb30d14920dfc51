"""OpenAI `response_format` and `tools` -> the request's constraint and prompt, and the
generated text -> OpenAI `tool_calls`.

HTTP `tools`, `tool_choice` and `parallel_tool_calls` become the GenerateRequest's `tools`,
`tool_choice` and `single_tool_call` (gRPC clients set those directly); `apply_tools` then
reads them the same way for both edges:

- "none": the tools are ignored.
- a named function: the answer is constrained to one call of it, `{"name": ..., "arguments":
  {...}}` with arguments valid against its parameters' schema (finish_reason "stop", as
  OpenAI and vLLM give it).
- "required": constrained to a JSON list of such calls (one or more, each of a listed tool;
  a single call when `single_tool_call`), finish_reason "tool_calls".
- "auto": the model writes freely; an answer that is such a call (or list of calls, bare or
  inside `<tool_call>` tags) is reported as calls, finish_reason "tool_calls".

The tools reach the model through the chat template's own `tools` argument when the
template uses it (prompt.py); otherwise a system message lists them (`tool_note`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import InvalidRequestError
from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2
from pdserve.router.guided import set_constraint

MAX_TOOLS = 128
_TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def set_response_format(value: Any, sampling: common_pb2.SamplingParams) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        set_constraint(sampling, "json_object", True, "response_format")
        return
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _invalid("response_format json_schema needs 'json_schema': {'schema': {...}}", "response_format")
        set_constraint(sampling, "json_schema", schema, "response_format")
        return
    raise _invalid("response_format 'type' must be text, json_object or json_schema", "response_format")


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How the answer is read: not at all (""), "auto" (calls if it is calls), "required";
    `named`: tool_choice named the function (its call finishes with "stop")."""

    mode: str = ""
    names: tuple[str, ...] = ()
    named: bool = False

    @property
    def call_finish_reason(self) -> str:
        return "stop" if self.named else "tool_calls"


def read_tools(raw: dict[str, Any], request: generation_pb2.GenerateRequest) -> None:
    """HTTP `tools`, `tool_choice`, `parallel_tool_calls` -> the request's proto fields."""
    tools = raw.get("tools")
    if not tools:
        return
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _invalid(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _invalid("each tool must be {'type': 'function', 'function': {'name': ...}}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _invalid(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object", "tools")
        request.tools.add(name=fn["name"], description=fn.get("description") or "",
                          parameters_json=json.dumps(params) if params is not None else "")
    choice = raw.get("tool_choice")
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if not isinstance(name, str) or not name:
            raise _invalid("'tool_choice' must be none, auto, required or {'type': 'function', "
                           "'function': {'name': ...}}", "tool_choice")
        choice = name
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise _invalid("'tool_choice' must be none, auto, required or a function of 'tools'", "tool_choice")
    request.tool_choice = choice or "auto"
    parallel = raw.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    request.single_tool_call = parallel is False


def _parameters(tool: generation_pb2.Tool) -> dict[str, Any]:
    if not tool.parameters_json:
        return {"type": "object", "properties": {}}  # OpenAI: a function without parameters
    try:
        params = json.loads(tool.parameters_json)
    except ValueError:
        raise _invalid(f"tool {tool.name!r}: parameters_json is not JSON", "tools") from None
    if not isinstance(params, dict):
        raise _invalid(f"tool {tool.name!r}: its parameters must be a JSON schema object", "tools")
    return params


def listed_tools(request: generation_pb2.GenerateRequest) -> list[dict[str, Any]]:
    """The tools the model is told of, in OpenAI's shape (none for tool_choice "none"; only
    the named one for a named tool_choice)."""
    if not request.tools or request.tool_choice == "none":
        return []
    named = request.tool_choice not in ("", "auto", "required")
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": _parameters(t)}}
            for t in request.tools if not named or t.name == request.tool_choice]


def tool_note(tools: list[dict[str, Any]], several: bool) -> str:
    """The system message that lists `tools` when the chat template takes none."""
    listing = json.dumps([t["function"] for t in tools])
    note = (f"You can call these functions: {listing}\nTo call one, answer with only a JSON object "
            f'{{"name": <function name>, "arguments": <its arguments>}}.')
    return note + (" To call several, answer with a JSON list of such objects." if several else "")


def _call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"]["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def apply_tools(request: generation_pb2.GenerateRequest) -> ToolMode:
    """Check the request's tools, constrain it for tool_choice; how to read the answer."""
    if not request.tools:
        return ToolMode()
    if request.WhichOneof("input") != "chat":
        raise _invalid("'tools' need a chat prompt", "tools")
    names = [t.name for t in request.tools]
    if len(set(names)) != len(names):
        raise _invalid("tool names must be unique", "tools")
    choice = request.tool_choice or "auto"
    if choice not in ("auto", "none", "required") and choice not in names:
        raise _invalid("'tool_choice' must be none, auto, required or a function of 'tools'", "tool_choice")
    tools = listed_tools(request)
    if choice == "none":
        return ToolMode()
    if request.sampling.HasField("constraint") and request.sampling.constraint.WhichOneof("kind"):
        raise _invalid("'tools' and a structured-output constraint cannot be combined", "tools")
    allowed = tuple(t["function"]["name"] for t in tools)
    if choice == "auto":
        return ToolMode("auto", allowed)
    schema = _call_schema(tools)
    if choice == "required" and not request.single_tool_call:
        schema = {"type": "array", "items": schema, "minItems": 1}
    set_constraint(request.sampling, "json_schema", schema, "tool_choice")
    return ToolMode("required", allowed, named=choice != "required")


def grpc_tool_calls(text: str, mode: ToolMode) -> list[generation_pb2.ToolCall]:
    """The ToolCall messages of an answer (none when it is not a call of a known tool)."""
    return [generation_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments_json=c["function"]["arguments"])
            for c in tool_calls(text, mode) or ()]


def _candidates(text: str) -> list[Any] | None:
    """The JSON values an answer holds as calls: itself, or its <tool_call> blocks."""
    tagged = _TAGGED_CALL.findall(text)
    try:
        values = [json.loads(t) for t in tagged] if tagged else [json.loads(text)]
    except ValueError:
        return None
    out: list[Any] = []
    for value in values:
        out.extend(value if isinstance(value, list) else [value])
    return out


def tool_calls(text: str, mode: ToolMode) -> list[dict[str, Any]] | None:
    """The OpenAI tool_calls of an answer, or None when it is not wholly calls of known tools."""
    values = _candidates(text)
    if not values:
        return None
    calls = []
    for value in values:
        arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
        if not (isinstance(value, dict) and value.get("name") in mode.names and isinstance(arguments, dict)):
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": value["name"], "arguments": json.dumps(arguments)}})
    return calls


def may_be_calls(text: str) -> bool:
    """Whether an answer that starts with `text` may still turn out to be calls."""
    start = text.lstrip()
    return start.startswith(("{", "[", "<tool_call>")) or "<tool_call>".startswith(start)


def stream_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A streamed delta's `tool_calls` entries (OpenAI's shape: each call with its index)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


def history_tool_calls(value: Any) -> list[generation_pb2.ToolCall]:
    """An assistant message's OpenAI `tool_calls` -> ToolCall messages (arguments kept as text)."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _invalid(f"a message's 'tool_calls' must be a list of at most {MAX_TOOLS} calls", "messages")
    out = []
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _invalid("each tool call must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}",
                           "messages")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.append(generation_pb2.ToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments_json=arguments))
    return out


def template_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """ToolCall messages as chat templates read them: OpenAI's shape, arguments as an object
    when they are JSON (as transformers and vLLM hand them to templates)."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.arguments_json or "{}")
        except ValueError:
            arguments = call.arguments_json
        out.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
    return out


def calls_as_text(calls: Any) -> str:
    """An assistant turn's calls in the form the tool note asks for (templates without tools)."""
    values = [{"name": c.name, "arguments": _loads_or_text(c.arguments_json)} for c in calls]
    return json.dumps(values[0] if len(values) == 1 else values)


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return text
