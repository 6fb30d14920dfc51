"""Structured output as clients ask for it -> one compiled llguidance constraint.

The forms: OpenAI's `response_format` (json_object, json_schema), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (Lark or GBNF), `guided_whitespace_pattern`
and the newer `structured_outputs` object ({json, regex, choice, grammar, json_object,
whitespace_pattern}); on gRPC, the kinds of `Constraint`. At most one form per request.

Schema-true JSON (xgrammar's default, which vLLM's users rely on): every object schema that
does not say `additionalProperties` (or `patternProperties`/`unevaluatedProperties`) is
closed, so only the keys it names may appear; a key never appears twice (llguidance) and
no whitespace is allowed between JSON tokens unless a whitespace pattern says which.
`GuidedOptions.lenient_json_schema` keeps object schemas open, as JSON Schema reads them.

The router compiles every form here, once, and checks it with llguidance (no tokenizer
needed): a bad schema, regex or grammar is INVALID_ARGUMENT before any worker is asked.
Workers receive `Constraint.llguidance` only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import EXPECTED_ERRORS, InvalidRequestError
from pdserve.proto.pdserve.v1 import common_pb2

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar; the engine's limit on a schema
MAX_CHOICES = 1024
_OPENS_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# schema keywords whose value is one subschema / a list of them / a name -> subschema map
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
              "propertyNames", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# vLLM's guided_* fields -> the Constraint kind each sets
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
STRUCTURED_FIELDS = frozenset(_STRUCTURED_KEYS) | {"whitespace_pattern"}  # the structured_outputs keys read


@dataclass(frozen=True, slots=True)
class GuidedOptions:
    """The router's structured-output settings."""

    lenient_json_schema: bool = False  # object schemas stay open unless they close themselves


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def close_objects(schema: Any, inside_all_of: bool = False) -> Any:
    """A copy of `schema` where every object schema (a "type" of object, or "properties")
    that says nothing of extra keys gets `additionalProperties: false`. Not the members of
    an allOf (their keys add up), nor a schema that is only an allOf: JSON Schema would
    then refuse every key its members name."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, inside_all_of=True) for s in out["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if _is_object_schema(out) and not inside_all_of and not any(k in out for k in _OPENS_OBJECT):
        out["additionalProperties"] = False
    return out


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def set_constraint(sampling: common_pb2.SamplingParams, kind: str, value: Any, param: str) -> None:
    """Put one client form into `sampling.constraint` (shape checks only; `compile_constraint`
    checks the content). Two forms in one request are INVALID_ARGUMENT."""
    if sampling.HasField("constraint") and sampling.constraint.WhichOneof("kind"):
        raise _invalid(f"'{param}': only one structured-output form per request "
                       f"(already {sampling.constraint.WhichOneof('kind')})", param)
    constraint = sampling.constraint
    if kind == "json_object":
        constraint.json_object = True
    elif kind == "json_schema":
        if isinstance(value, str):
            value = _parse_json(value, param)
        if not isinstance(value, dict):
            raise _invalid(f"'{param}' must be a JSON schema (an object)", param)
        constraint.json_schema = json.dumps(value)
    elif kind == "choice":
        if not (isinstance(value, list) and value and len(value) <= MAX_CHOICES
                and all(isinstance(c, str) for c in value)):
            raise _invalid(f"'{param}' must be a non-empty list of at most {MAX_CHOICES} strings", param)
        constraint.choice.choices.extend(value)
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise _invalid(f"'{param}' must be a non-empty string", param)
        setattr(constraint, kind, value)


def _parse_json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _invalid(f"'{param}' is not JSON: {exc}", param) from None


def set_whitespace_pattern(sampling: common_pb2.SamplingParams, value: Any, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, str) or len(value) > 256:
        raise _invalid(f"'{param}' must be a regex string of at most 256 characters", param)
    sampling.constraint.whitespace_pattern = value


def read_guided(raw: dict[str, Any], sampling: common_pb2.SamplingParams) -> None:
    """vLLM's guided_* fields and `structured_outputs` of an HTTP body, into `sampling`."""
    for name, kind in GUIDED_FIELDS.items():
        if raw.get(name) is not None:
            set_constraint(sampling, kind, raw[name], name)
    if raw.get("guided_json_object") is True:
        set_constraint(sampling, "json_object", True, "guided_json_object")
    structured = raw.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise _invalid("'structured_outputs' must be an object", "structured_outputs")
        for key, kind in _STRUCTURED_KEYS.items():
            if structured.get(key) not in (None, False):
                set_constraint(sampling, kind, structured[key], f"structured_outputs.{key}")
        set_whitespace_pattern(sampling, structured.get("whitespace_pattern"), "structured_outputs.whitespace_pattern")
    set_whitespace_pattern(sampling, raw.get("guided_whitespace_pattern"), "guided_whitespace_pattern")
    if sampling.HasField("constraint") and not sampling.constraint.WhichOneof("kind"):
        raise _invalid("a whitespace pattern needs a JSON constraint", "guided_whitespace_pattern")


def compile_constraint(sampling: common_pb2.SamplingParams, options: GuidedOptions) -> None:
    """Replace the client's constraint form by its checked llguidance grammar (in place).
    INVALID_ARGUMENT for a malformed schema, regex or grammar."""
    if not sampling.HasField("constraint"):
        return
    constraint = sampling.constraint
    kind = constraint.WhichOneof("kind")
    if kind == "llguidance" or (kind == "json_object" and not constraint.json_object):
        return
    if kind is None:
        raise _invalid("a constraint needs a kind (json_object, json_schema, regex, choice or grammar)", "constraint")
    grammar = _grammar(constraint, kind, options)
    _check(grammar, kind)
    sampling.constraint.Clear()
    sampling.constraint.llguidance = grammar


def _grammar(constraint: common_pb2.Constraint, kind: str, options: GuidedOptions) -> str:
    import llguidance

    if constraint.whitespace_pattern and kind not in ("json_object", "json_schema"):
        raise _invalid("a whitespace pattern applies to JSON constraints only", "guided_whitespace_pattern")
    spec = list(constraint.choice.choices) if kind == "choice" else getattr(constraint, kind)
    if kind != "json_object":
        _check_size(kind, [spec] if isinstance(spec, str) else spec)
    try:
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)  # Lark as is, GBNF converted
        schema = _parse_json(spec, "json_schema") if kind == "json_schema" else {"type": "object"}
        if kind == "json_schema" and not options.lenient_json_schema:
            schema = close_objects(schema)
        json_options: dict[str, Any] = {"whitespace_flexible": False}
        if constraint.whitespace_pattern:
            json_options["whitespace_pattern"] = constraint.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=json_options)
    except EXPECTED_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's message names the fault
        raise _invalid(f"unsupported {kind}: {exc}", kind) from None


def _check_size(kind: str, parts: list[str]) -> None:
    if not parts or not all(parts) or (kind == "choice" and len(parts) > MAX_CHOICES):
        raise _invalid(f"the {kind} constraint must not be empty (a choice: 1 to {MAX_CHOICES} non-empty "
                       "strings)", kind)
    if sum(len(p) for p in parts) > MAX_SPEC_CHARS:
        raise _invalid(f"the {kind} constraint is over {MAX_SPEC_CHARS} characters", kind)


def _check(grammar: str, kind: str) -> None:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        what = "JSON schema" if kind in ("json_object", "json_schema") else kind
        raise _invalid(f"unsupported {what}: {messages[0].strip()}", kind)
