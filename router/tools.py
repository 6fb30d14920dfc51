"""OpenAI `response_format` and `tools` -> a grammar constraint on the request, and the
generated text -> OpenAI `tool_calls`.

`response_format` json_object / json_schema constrain the output to JSON (to the schema).
With `tools` and `tool_choice` "required" or a named function, the output is constrained to
`{"name": <a tool>, "arguments": <its parameters' schema>}` and answered as a tool call
(finish_reason "tool_calls"); with "auto" the model writes freely and an answer that is such
a JSON call becomes a tool call; "none" ignores the tools. The tool list is shown to the model
in a system message (the chat templates of small models take no `tools`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import ErrorKind, ServiceError
from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2

MAX_TOOLS = 128


def _invalid(message: str, param: str) -> ServiceError:
    return ServiceError(ErrorKind.INVALID_ARGUMENT, message, param=param)


def set_response_format(value: Any, sampling: common_pb2.SamplingParams) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        sampling.constraint.json_object = True
        return
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _invalid("response_format json_schema needs 'json_schema': {'schema': {...}}", "response_format")
        sampling.constraint.json_schema = json.dumps(schema)
        return
    raise _invalid("response_format 'type' must be text, json_object or json_schema", "response_format")


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How the answer is read: not at all (""), "auto" (a JSON call if it is one), "required"."""

    mode: str = ""
    names: tuple[str, ...] = ()


def _functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _invalid(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _invalid("each tool must be {'type': 'function', 'function': {'name': ...}}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise _invalid(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object", "tools")
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    return out


def _call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _chosen(functions: list[dict[str, Any]], choice: Any) -> tuple[str, list[dict[str, Any]]]:
    """(mode, the functions the call may name) for a tool_choice."""
    if choice is None or choice == "auto":
        return "auto", functions
    if choice in ("none", "required"):
        return choice, functions
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    picked = [f for f in functions if f["name"] == name]
    if not picked:
        raise _invalid("'tool_choice' must be none, auto, required or a function of 'tools'", "tool_choice")
    return "required", picked


def apply_tools(raw: dict[str, Any], request: generation_pb2.GenerateRequest) -> ToolMode:
    """Constrain `request` for its tools (and tell the model about them); how to read the answer."""
    if not raw.get("tools"):
        return ToolMode()
    if request.sampling.HasField("constraint"):
        raise _invalid("'tools' and a JSON response_format cannot be combined", "tools")
    functions = _functions(raw["tools"])
    mode, allowed = _chosen(functions, raw.get("tool_choice"))
    if mode == "none":
        return ToolMode()
    schema = _call_schema(allowed)
    if mode == "required":
        request.sampling.constraint.json_schema = json.dumps(schema)
    listing = json.dumps([{k: f[k] for k in ("name", "description", "parameters")} for f in allowed])
    note = (f"You can call these functions: {listing}\nTo call one, answer with only a JSON object "
            f'{{"name": <function name>, "arguments": <its arguments>}}.')
    messages = request.chat.messages
    if messages and messages[0].role == "system":
        messages[0].content = f"{messages[0].content}\n\n{note}"
    else:
        turns = list(messages)
        del messages[:]
        messages.add(role="system", content=note)
        messages.extend(turns)
    return ToolMode(mode, tuple(f["name"] for f in allowed))


def apply_grpc_tools(request: generation_pb2.GenerateRequest) -> ToolMode:
    """`apply_tools` for a gRPC request's `tools` and `tool_choice` fields."""
    if not request.tools:
        return ToolMode()
    if request.WhichOneof("input") != "chat":
        raise _invalid("'tools' need a chat prompt", "tools")
    tools = []
    for tool in request.tools:
        function: dict[str, Any] = {"name": tool.name, "description": tool.description}
        if tool.parameters_json:
            try:
                function["parameters"] = json.loads(tool.parameters_json)
            except ValueError:
                raise _invalid(f"tool {tool.name!r}: parameters_json is not JSON", "tools") from None
        tools.append({"type": "function", "function": function})
    choice: Any = request.tool_choice or "auto"
    if choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return apply_tools({"tools": tools, "tool_choice": choice}, request)


def grpc_tool_calls(text: str, mode: ToolMode) -> list[generation_pb2.ToolCall]:
    """The ToolCall messages of an answer (none when it is not a call of a known tool)."""
    return [generation_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments_json=c["function"]["arguments"])
            for c in tool_calls(text, mode) or ()]


def tool_calls(text: str, mode: ToolMode) -> list[dict[str, Any]] | None:
    """The OpenAI tool_calls of an answer, or None when it is not a call of a known tool."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(value, dict) and value.get("name") in mode.names and isinstance(value.get("arguments"), dict)):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])}}]
