"""The sampling table (common.sampling): each row's default and bounds, the list caps, the
max_tokens default on every path, and the router and the engine refusing the same values
with the same error."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from pdserve.common.errors import EXPECTED_ERRORS, ErrorKind, InvalidRequestError, PromptTooLongError, to_service_error
from pdserve.common.sampling import (BOUNDS, COMPLETIONS_MAX_TOKENS, LOGIT_BIAS, MAX_LOGIT_BIAS, MAX_STOP_CHARS,
                                     MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SamplingValues,
                                     check_vocab, resolve_max_tokens)
from pdserve.engine.request import check_prompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.openai_request import parse_chat, parse_completion
from pdserve.router.validation import resolve_sampling
from pdserve.worker.convert import sampling_from_proto

CTX, VOCAB, PROMPT = 100, 50, 10
UINT32 = 2**32 - 1


def test_defaults():
    v = SamplingValues()
    assert (v.max_tokens, v.min_tokens, v.temperature, v.top_p, v.top_k, v.seed) == (None, 0, 1.0, 1.0, 0, None)
    assert (v.presence_penalty, v.frequency_penalty, v.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (v.logprobs, v.prompt_logprobs, v.stop, v.stop_token_ids, v.ignore_eos, v.logit_bias) == \
        (None, None, (), (), False, ())
    assert SamplingValues.from_message(common_pb2.SamplingParams()) == v  # unset on the wire: the row's default
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()  # the worker adds none of its own


BOUNDS_CASES = [  # row, values it takes, values it refuses
    ("max_tokens", [1, UINT32], [0, UINT32 + 1, 1.5, True]),
    ("min_tokens", [0, UINT32], [-1, 2.0]),
    ("temperature", [0, 0.0, 2, 2.0], [-0.01, 2.01, math.nan, math.inf, "1"]),
    ("top_p", [1e-9, 1.0], [0.0, 1.01, -1.0]),
    ("top_k", [0, 1, UINT32], [-1]),
    ("seed", [-(2**63), 0, 2**63 - 1], [-(2**63) - 1, 2**63]),
    ("presence_penalty", [-2.0, 2.0], [-2.01, 2.01]),
    ("frequency_penalty", [-2.0, 2.0], [-2.01, 2.01]),
    ("repetition_penalty", [1e-6, 100.0], [0.0, -1.0, 100.01]),
    ("logprobs", [0, MAX_TOP_LOGPROBS], [-1, MAX_TOP_LOGPROBS + 1]),
    ("prompt_logprobs", [0, MAX_TOP_LOGPROBS], [-1, MAX_TOP_LOGPROBS + 1]),
]


def test_every_numeric_row_is_covered():
    assert {name for name, _, _ in BOUNDS_CASES} == set(BOUNDS)


@pytest.mark.parametrize("name, good, bad", BOUNDS_CASES, ids=[c[0] for c in BOUNDS_CASES])
def test_each_bound(name, good, bad):
    for value in good:
        assert getattr(SamplingValues(**{name: value}), name) == value
    param = BOUNDS[name].request_name or name
    for value in bad:
        with pytest.raises(InvalidRequestError) as caught:
            SamplingValues(**{name: value})
        assert caught.value.param == param, value


@pytest.mark.parametrize("fields, param", [
    (dict(max_tokens=5, min_tokens=6), "min_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
])
def test_caps_and_cross_field_rules(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingValues(**fields)
    assert caught.value.param == param


def test_caps_take_their_limit():
    v = SamplingValues(max_tokens=5, min_tokens=5, stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
                       stop_token_ids=[1] * MAX_STOP_TOKEN_IDS, logit_bias={1: -100, 2: 100})
    assert v.logit_bias == ((1, -100.0), (2, 100.0)) and SamplingValues(stop="\n").stop == ("\n",)
    check_vocab(SamplingValues(stop_token_ids=[9], logit_bias={9: 1.0}), 10)
    for fields, param in ((dict(stop_token_ids=[10]), "stop_token_ids"), (dict(logit_bias={10: 1.0}), "logit_bias")):
        with pytest.raises(InvalidRequestError) as caught:
            check_vocab(SamplingValues(**fields), 10)
        assert caught.value.param == param


def test_max_tokens_defaults_to_the_room_left_in_the_context():
    assert resolve_max_tokens(SamplingValues(), PROMPT, CTX).max_tokens == CTX - PROMPT
    assert resolve_max_tokens(SamplingValues(max_tokens=CTX - PROMPT), PROMPT, CTX).max_tokens == CTX - PROMPT
    with pytest.raises(PromptTooLongError) as caught:
        resolve_max_tokens(SamplingValues(max_tokens=CTX - PROMPT + 1), PROMPT, CTX)
    assert caught.value.param == "max_tokens"
    assert to_service_error(caught.value).openai_body()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(InvalidRequestError) as caught:  # min_tokens past the room the default leaves
        resolve_max_tokens(SamplingValues(min_tokens=CTX), PROMPT, CTX)
    assert caught.value.param == "min_tokens"


def test_every_path_gives_unset_max_tokens_the_same_default():
    """The room left in the context, but OpenAI's legacy completions, whose API says 16."""
    room = CTX - PROMPT
    message = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    completions = parse_completion({"model": "m", "prompt": "x"}).request.sampling
    assert resolve_sampling(completions, PROMPT, CTX, VOCAB).max_tokens == COMPLETIONS_MAX_TOKENS
    paths = {
        "http chat": parse_chat(message).request.sampling,
        "grpc": common_pb2.SamplingParams(),
    }
    for path, sampling in paths.items():
        assert resolve_sampling(sampling, PROMPT, CTX, VOCAB).max_tokens == room, path
    assert check_prompt(list(range(PROMPT)), SamplingParams(), VOCAB, CTX).max_tokens == room  # the engine
    unresolved = sampling_from_proto(common_pb2.SamplingParams())  # a Decode call that left it unset
    assert check_prompt(list(range(PROMPT)), unresolved, VOCAB, CTX).max_tokens == room


# The same out-of-range value as an OpenAI body, a gRPC SamplingParams (None: the wire cannot
# hold it) and the engine's SamplingParams.
SAME_REFUSAL = [
    ({"temperature": 2.5}, dict(temperature=2.5), dict(temperature=2.5)),
    ({"temperature": -0.5}, dict(temperature=-0.5), dict(temperature=-0.5)),
    ({"top_p": 0}, dict(top_p=0.0), dict(top_p=0.0)),
    ({"top_p": 1.5}, dict(top_p=1.5), dict(top_p=1.5)),
    ({"top_k": -2}, None, dict(top_k=-2)),
    ({"presence_penalty": 2.5}, dict(presence_penalty=2.5), dict(presence_penalty=2.5)),
    ({"frequency_penalty": -3}, dict(frequency_penalty=-3), dict(frequency_penalty=-3.0)),
    ({"repetition_penalty": 0}, dict(repetition_penalty=0), dict(repetition_penalty=0.0)),
    ({"repetition_penalty": 101}, dict(repetition_penalty=101), dict(repetition_penalty=101.0)),
    ({"logprobs": True, "top_logprobs": 21}, dict(logprobs=True, top_logprobs=21), dict(logprobs=21)),
    ({"prompt_logprobs": 21}, dict(prompt_logprobs=21), dict(prompt_logprobs=21)),
    ({"max_tokens": 0}, dict(max_tokens=0), dict(max_tokens=0)),
    ({"max_tokens": 5, "min_tokens": 6}, dict(max_tokens=5, min_tokens=6), dict(max_tokens=5, min_tokens=6)),
    ({"stop": [""]}, dict(stop=[""]), dict(stop=("",))),
    ({"stop": ["x"] * 17}, dict(stop=["x"] * 17), dict(stop=("x",) * 17)),
    ({"logit_bias": {"1": 101}}, dict(logit_bias={1: 101}), dict(logit_bias=((1, 101.0),))),
    ({"stop_token_ids": [1] * 257}, dict(stop_token_ids=[1] * 257), dict(stop_token_ids=(1,) * 257)),
]


def _router_error(body: dict | None, proto: dict | None):
    """The router's error for an OpenAI chat body or a gRPC SamplingParams."""
    try:
        if body is not None:
            chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
            sampling = parse_chat(chat).request.sampling
        else:
            sampling = common_pb2.SamplingParams(**proto)
        resolve_sampling(sampling, PROMPT, CTX, VOCAB)
    except EXPECTED_ERRORS as err:
        return to_service_error(err)
    pytest.fail(f"the router took {body or proto}")


@pytest.mark.parametrize("body, proto, engine", SAME_REFUSAL, ids=[str(c[0])[:40] for c in SAME_REFUSAL])
def test_router_and_engine_refuse_the_same_values_the_same_way(body, proto, engine):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**engine)
    refused = caught.value
    assert refused.param is not None

    http = _router_error(body, None)
    assert http.http_status == 400
    assert http.openai_body() == {"error": {"message": str(refused), "type": "invalid_request_error",
                                            "param": refused.param, "code": None}}
    if proto is not None:
        grpc = _router_error(None, proto)
        assert (grpc.grpc_code, grpc.message, grpc.param) == ("INVALID_ARGUMENT", str(refused), refused.param)
        with pytest.raises(InvalidRequestError) as at_worker:  # a Decode call the router did not check
            sampling_from_proto(common_pb2.SamplingParams(**proto))
        assert (str(at_worker.value), at_worker.value.param) == (str(refused), refused.param)


def test_max_tokens_past_the_context_is_refused_alike():
    too_many = CTX - PROMPT + 1
    http = _router_error({"max_tokens": too_many}, None)
    with pytest.raises(PromptTooLongError) as caught:
        check_prompt(list(range(PROMPT)), SamplingParams(max_tokens=too_many), VOCAB, CTX)
    engine = to_service_error(caught.value)
    assert http.kind is engine.kind is ErrorKind.INVALID_ARGUMENT
    assert http.openai_body() == engine.openai_body()
    assert http.openai_body()["error"]["code"] == "context_length_exceeded"


def test_token_ids_outside_the_vocabulary_are_refused_alike():
    http = _router_error({"logit_bias": {str(VOCAB): 1}}, None)
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt(list(range(PROMPT)), SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB, CTX)
    assert (http.message, http.param) == (str(caught.value), caught.value.param) == (http.message, "logit_bias")


def test_a_resolved_request_converts_to_the_same_engine_values():
    sampling = resolve_sampling(common_pb2.SamplingParams(temperature=0.5, seed=-3), PROMPT, CTX, VOCAB)
    params = sampling_from_proto(sampling)
    assert params == dataclasses.replace(SamplingParams(), max_tokens=CTX - PROMPT, temperature=0.5, seed=-3)


def _proto_comments() -> dict[str, str]:
    """Each SamplingParams field of common.proto -> the comment above it."""
    text = Path(common_pb2.__file__).with_name("common.proto").read_text()
    body = text[text.index("message SamplingParams {"):]
    comments, pending = {}, []
    for line in body[:body.index("\n}")].splitlines()[1:]:
        line = line.strip()
        if line.startswith("//"):
            pending.append(line[2:].strip())
        elif declared := re.match(r"(?:optional |repeated )?[\w<>, ]+ (\w+) = \d+;", line):
            comments[declared[1]], pending = " ".join(pending), []
    return comments


def test_the_protos_comments_quote_the_table():
    """What gRPC clients read: a range or an unset default a field's comment states is its row's."""
    comments = _proto_comments()
    for name, bounds in BOUNDS.items():
        comment = comments[bounds.request_name or name]
        ranges = re.findall(r"[\[(]-?[\d.]+, -?[\d.]+\]", comment)
        ranges += [f"[{lo}, {hi}]" for lo, hi in re.findall(r"\((\d+)\.\.(\d+)\)", comment)]
        assert all(stated == str(bounds) for stated in ranges), (name, ranges, str(bounds))
        for default in re.findall(r"Unset: (-?\d+(?:\.\d+)?)", comment):
            assert float(default) == getattr(SamplingValues(), name), name
    assert str(LOGIT_BIAS) in comments["logit_bias"]
    assert f"at most {MAX_STOP_STRINGS}" in comments["stop"]
