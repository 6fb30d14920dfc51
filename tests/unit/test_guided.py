"""Structured-output grammars as the router builds them (router/guided.py) and the engine
compiles them (engine/constraints.py) for SmolLM2's real tokenizer: closed objects, no
duplicate keys, bounded whitespace, vLLM's guided_* forms, errors before any worker."""
from __future__ import annotations


import pytest

from pdserve.common.errors import EXPECTED_ERRORS, ErrorKind
from pdserve.engine.constraints import Constraint, GrammarCompiler
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.guided import GuidedOptions, close_objects, compile_constraint, read_guided
from pdserve.router.openai_request import parse_chat, parse_completion

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def compiler():
    from pdserve.engine.loader import load_model

    tokenizer = load_model("default").tokenizer
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def _grammar(raw: dict, options: GuidedOptions = GuidedOptions()) -> Constraint:
    sampling = common_pb2.SamplingParams()
    read_guided(raw, sampling)
    compile_constraint(sampling, options)
    assert sampling.constraint.WhichOneof("kind") == "llguidance"
    return Constraint("llguidance", sampling.constraint.llguidance)


def _accepts(compiler, constraint: Constraint, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` (token by token) and stop."""
    tokenizer, grammars = compiler
    matcher = grammars.matcher(constraint)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not bool(matcher.allowed()[token_id]):
            return False
        matcher.advance(token_id)
    return bool(matcher.allowed()[tokenizer.eos_token_id])


def test_close_objects_closes_every_object_that_does_not_say_otherwise():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "additionalProperties": {"type": "string"}},
        "list": {"type": "array", "items": {"properties": {"c": {"type": "string"}}}},
        "either": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}},
        "$defs": {"d": {"type": "object"}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] == {"type": "string"}  # said: kept
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in \
        props["either"]["anyOf"][1]
    # the members of an allOf are not closed (their keys add up), nor is a schema that is
    # only an allOf (closing it would refuse every key its members name)
    assert all("additionalProperties" not in s for s in props["both"]["allOf"])
    assert "additionalProperties" not in props["both"]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert schema["properties"]["a"] == {"type": "object", "properties": {"b": {"type": "integer"}}}  # a copy


def test_schemas_are_closed_without_duplicates_or_free_whitespace(compiler):
    strict = _grammar({"guided_json": CITY})
    assert _accepts(compiler, strict, '{"city":"Paris"}')
    assert not _accepts(compiler, strict, '{"city":"Paris","type":"string"}')  # a key the schema never named
    assert not _accepts(compiler, strict, '{"city":"Paris","city":"Rome"}')  # a key twice
    assert not _accepts(compiler, strict, '{"city": "Paris"}')  # whitespace: none unless a pattern says
    lenient = _grammar({"guided_json": CITY}, GuidedOptions(lenient_json_schema=True))
    assert _accepts(compiler, lenient, '{"city":"Paris","type":"string"}')
    assert not _accepts(compiler, lenient, '{"city":"Paris","city":"Rome"}')
    spaced = _grammar({"guided_json": CITY, "guided_whitespace_pattern": "[ ]?"})
    assert _accepts(compiler, spaced, '{"city": "Paris"}') and not _accepts(compiler, spaced, '{"city":  "Paris"}')


def test_vllm_forms_constrain_the_output(compiler):
    regex = _grammar({"guided_regex": r"[0-9]{3}-[a-z]+"})
    assert _accepts(compiler, regex, "123-abc") and not _accepts(compiler, regex, "12-abc")
    choice = _grammar({"guided_choice": ["yes", "no", "it \"depends\""]})
    assert _accepts(compiler, choice, "no") and _accepts(compiler, choice, 'it "depends"')
    assert not _accepts(compiler, choice, "maybe")
    lark = _grammar({"guided_grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]+/'})
    assert _accepts(compiler, lark, "(1+22+3)") and not _accepts(compiler, lark, "(1+)")
    gbnf = _grammar({"guided_grammar": 'root ::= "a" "b"*'})
    assert _accepts(compiler, gbnf, "abbb") and not _accepts(compiler, gbnf, "ba")
    structured = _grammar({"structured_outputs": {"regex": "(cat|dog)s?"}})
    assert _accepts(compiler, structured, "dogs") and not _accepts(compiler, structured, "bird")
    obj = _grammar({"structured_outputs": {"json_object": True}})
    assert _accepts(compiler, obj, '{"any":1}')  # json_object: any object, open


@pytest.mark.parametrize("raw, param", [
    ({"guided_regex": "a(b"}, "regex"),
    ({"guided_grammar": "start: nowhere"}, "grammar"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
])
def test_bad_forms_are_invalid_argument_at_the_router(raw, param):
    with pytest.raises(EXPECTED_ERRORS) as caught:
        _grammar(raw)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT and caught.value.param == param


def test_http_bodies_carry_the_forms_and_list_unknown_fields():
    user = [{"role": "user", "content": "x"}]
    chat = parse_chat({"model": "m", "messages": user, "guided_choice": ["a", "b"], "guided_regexx": "typo",
                       "prompt_logprobs": 2})
    assert list(chat.request.sampling.constraint.choice.choices) == ["a", "b"]
    assert chat.ignored_fields == ("guided_regexx",) and chat.request.sampling.prompt_logprobs == 2
    completion = parse_completion({"model": "m", "prompt": "p", "guided_grammar": "start: \"x\"",
                                   "structured_outputs": {"disable_fallback": True}, "foo": 1, "bar": None})
    assert completion.request.sampling.constraint.grammar == 'start: "x"'
    assert completion.ignored_fields == ("bar", "foo", "structured_outputs.disable_fallback")
    with pytest.raises(EXPECTED_ERRORS):
        parse_chat({"model": "m", "messages": user, "guided_json": CITY,
                    "response_format": {"type": "json_object"}})


def test_tool_call_grammar_accepts_only_calls_that_validate(compiler):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    user = [{"role": "user", "content": "x"}]
    named = parse_chat({"model": "m", "messages": user, "tools": [tool],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    compile_constraint(named.request.sampling, GuidedOptions())
    grammar = Constraint("llguidance", named.request.sampling.constraint.llguidance)
    assert _accepts(compiler, grammar, '{"name":"get_weather","arguments":{"city":"Paris"}}')
    assert not _accepts(compiler, grammar, '{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}')
    required = parse_chat({"model": "m", "messages": user, "tools": [tool], "tool_choice": "required"})
    compile_constraint(required.request.sampling, GuidedOptions())
    several = Constraint("llguidance", required.request.sampling.constraint.llguidance)
    two = '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_weather","arguments":{"city":"Rome"}}]'
    assert _accepts(compiler, several, two)
    assert not _accepts(compiler, several, "[]")
    single = parse_chat({"model": "m", "messages": user, "tools": [tool], "tool_choice": "required",
                         "parallel_tool_calls": False})
    compile_constraint(single.request.sampling, GuidedOptions())
    one = Constraint("llguidance", single.request.sampling.constraint.llguidance)
    assert _accepts(compiler, one, '{"name":"get_weather","arguments":{"city":"Paris"}}')
    assert not _accepts(compiler, one, two)


def test_each_ignored_field_is_logged_once(caplog):
    from pdserve.router.openai_request import IgnoredFieldLog

    log = IgnoredFieldLog()
    with caplog.at_level("WARNING", logger="pdserve.router.http"):
        for _ in range(3):
            log.note(("guided_regexx", "min_p"), "/v1/chat/completions")
        log.note(("min_p", "top_a"), "/v1/completions")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and sum("'min_p'" in line for line in lines) == 1
    assert all("pdserve.ignored_fields" in line for line in lines)
