"""Render Hugging Face chat templates without transformers.

Same environment as transformers' `apply_chat_template`: a sandboxed, immutable Jinja
environment with trim_blocks and lstrip_blocks, the loop-controls extension, a `tojson`
filter that does not escape HTML, `raise_exception`, `strftime_now`, and the template
variables `messages`, `tools`, `documents`, `add_generation_prompt` plus every special
token of the tokenizer (`bos_token`, `eos_token`, ...). A template that raises (e.g. roles
that do not alternate) is the caller's error.

`takes_tools` and `renders_tool_calls` say whether the template reads the `tools` variable
and messages' `tool_calls` (Qwen's, Llama 3's do; SmolLM2's does not): the prompt builder
falls back to text for what the template would drop.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """One compiled template plus the special-token variables it sees."""

    def __init__(self, source: str, special_tokens: Mapping[str, str],
                 additional_special_tokens: Sequence[str] = ()) -> None:
        env = _make_environment()
        try:
            self._template = env.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        self.takes_tools = "tools" in variables
        self.renders_tool_calls = "tool_calls" in source
        self._variables: dict[str, Any] = dict(special_tokens)
        if additional_special_tokens:
            self._variables["additional_special_tokens"] = list(additional_special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """`tools`: OpenAI-shaped tool dicts for the template's `tools` variable (None: none)."""
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=list(tools) if tools else None,
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         **self._variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from None
