"""Constrained decoding in the engine (llguidance) on SmolLM2: JSON mode and JSON schema give
parseable, schema-valid output, greedy and sampled; a bad schema is a clear error."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.constraints import Constraint
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def llm(one_thread) -> LLM:
    return LLM("default", num_blocks=128)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 3), (1.0, 11)])
def test_json_schema_output_is_valid(llm, temperature, seed):
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=seed,
                            constraint=Constraint("json_schema", json.dumps(PERSON)))
    (out,) = llm.generate([PROMPT], params)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), PERSON)
    llm.engine.assert_no_leaks()


def test_json_object_mode_gives_an_object(llm):
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=60, temperature=0.0,
                                                   constraint=Constraint("json_object")))
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert out.text.startswith("{")
    llm.engine.assert_no_leaks()


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate([PROMPT], free)[0].text
    together = llm.generate([PROMPT, PROMPT], [free, SamplingParams(
        max_tokens=12, temperature=0.0, constraint=Constraint("json_schema", json.dumps(PERSON)))])
    assert together[0].text == alone and together[1].text.startswith("{")
    llm.engine.assert_no_leaks()


@pytest.mark.parametrize("schema", ["{not json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})])
def test_bad_schema_is_refused_and_nothing_leaks(llm, schema):
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPT], SamplingParams(constraint=Constraint("json_schema", schema)))
    llm.engine.assert_no_leaks()
