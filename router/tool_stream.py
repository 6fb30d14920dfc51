"""A constrained tool-call answer streamed as OpenAI `tool_calls` deltas while it is written.

Under tool_choice "required" or a named function the grammar fixes the answer's form
(compact JSON, keys in the schema's order, no whitespace): a call is
`{"name":"<tool>","arguments":<ARGS>}`, and "required" answers `[<call>,<call>...]`. So the
stream can be read as it comes: when a call's head `{"name":"<tool>","arguments":` is whole,
its first delta goes out (index, id, type, name, empty arguments), then every piece of ARGS as
an `arguments` fragment, as OpenAI and vLLM stream them. A client concatenating the fragments
of each index gets the arguments' JSON text.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

_ARGUMENTS_KEY = ',"arguments":'


class CallStream:
    """One choice's calls, read a piece of text at a time (one caller, one stream)."""

    def __init__(self) -> None:
        self._state = "between"  # "between" calls, in a call's "head", in its "args"
        self._head = ""  # the current call's text up to its arguments
        self._depth = 0  # nesting inside ARGS
        self._in_string = False
        self._escaped = False
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes: at most one entry per call index, in order."""
        entries: dict[int, dict[str, Any]] = {}
        for char in text:
            if self._state == "between":
                if char == "{":
                    self._state, self._head = "head", char
            elif self._state == "head":
                self._head += char
                if self._head.endswith(_ARGUMENTS_KEY):
                    self._start_call(entries)
            else:
                self._args_char(char, entries)
        return [entries[i] for i in sorted(entries)]

    def _start_call(self, entries: dict[int, dict[str, Any]]) -> None:
        name_json = self._head[len('{"name":'):-len(_ARGUMENTS_KEY)]
        try:
            name = json.loads(name_json)
        except ValueError:
            name = name_json  # the grammar writes a JSON string here; keep the text otherwise
        entries[self.num_calls] = {"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}",
                                   "type": "function", "function": {"name": name, "arguments": ""}}
        self.num_calls += 1
        self._state, self._depth, self._in_string, self._escaped = "args", 0, False, False

    def _args_char(self, char: str, entries: dict[int, dict[str, Any]]) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            if self._depth == 0:  # the call's own closing brace: its arguments are whole
                self._state = "between"
                return
            self._depth -= 1
        index = self.num_calls - 1
        entry = entries.setdefault(index, {"index": index, "function": {"arguments": ""}})
        entry["function"]["arguments"] += char
