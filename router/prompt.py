"""Turn a GenerateRequest's input (text, token ids or chat) into prompt token ids.

Built from a worker's ModelInfoResponse: the `tokenizers` library on tokenizer.json and the
chat template rendered by `chat_template.ChatTemplate` — no transformers, no torch. Chat
prompts are rendered with add_generation_prompt=True and tokenized without adding special
tokens, which is exactly transformers' `apply_chat_template(messages,
add_generation_prompt=True)`; text prompts are tokenized the way `tokenizer(text)` does
(special tokens added by the tokenizer's post-processor, e.g. a BOS).

A chat's tools go to the template's own `tools` argument when it reads one, else into a
system message (tools.tool_note); assistant `tool_calls` and `tool` results stay in the
history, as message fields when the template renders them, else as the calls' JSON text.
"""
from __future__ import annotations

from typing import Any, Sequence

from tokenizers import Tokenizer

from pdserve.common.errors import InvalidRequestError
from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2
from pdserve.router.chat_template import ChatTemplate, ChatTemplateError
from pdserve.router.tools import calls_as_text, listed_tools, template_tool_calls, tool_note

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# A prompt is refused before any tokenizing when its raw text is longer than this many
# characters per token of context: no tokenizer packs more into one token, so such a prompt
# can never fit, and tokenizing it first would let one request stall the router.
MAX_CHARS_PER_TOKEN = 32


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._vocab_size = vocab_size

    @classmethod
    def from_model_info(cls, info: common_pb2.ModelInfoResponse) -> "PromptBuilder":
        if not info.tokenizer_json:
            raise ValueError(f"model {info.model_name!r}: ModelInfo carries no tokenizer_json")
        tokenizer = Tokenizer.from_str(info.tokenizer_json.decode("utf-8"))
        template = None
        if info.chat_template:
            special = dict(info.special_tokens)
            special.setdefault("bos_token", info.bos_token)
            special.setdefault("eos_token", info.eos_token)
            template = ChatTemplate(info.chat_template, special, list(info.additional_special_tokens))
        vocab_size = info.vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        return cls(tokenizer, template, vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def build(self, request: generation_pb2.GenerateRequest, max_model_len: int) -> list[int]:
        """The prompt's token ids; INVALID_ARGUMENT for an empty or malformed input, and for
        text that cannot fit `max_model_len` tokens, checked on its raw size first."""
        check_raw_size(request, max_model_len)
        which = request.WhichOneof("input")
        if which == "prompt":
            ids = self.encode_text(request.prompt)
            param = "prompt"
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
            param = "prompt"
            check_token_ids(ids, self._vocab_size, param)
        elif which == "chat":
            ids = self.encode_chat(request.chat.messages, listed_tools(request), not request.single_tool_call)
            param = "messages"
        else:
            raise InvalidRequestError("one of prompt, token_ids or messages is required",
                                      param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param=param)
        return ids

    def echo_text(self, request: generation_pb2.GenerateRequest, ids: Sequence[int]) -> str:
        """The prompt's text as echoed: as given, a chat as its template rendered it, token
        ids decoded."""
        which = request.WhichOneof("input")
        if which == "prompt":
            return request.prompt
        if which == "chat":
            return self.render_chat(request.chat.messages, listed_tools(request), not request.single_tool_call)
        return self.decode(ids)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (special tokens kept); INVALID_ARGUMENT outside the vocabulary."""
        check_token_ids(ids, self._vocab_size, "tokens")
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self._tokenizer.id_to_token(i) or "" for i in ids]

    def render_chat(self, messages: Sequence[generation_pb2.ChatMessage],
                    tools: Sequence[dict[str, Any]] = (), several_calls: bool = True) -> str:
        """The chat as the template renders it, with `tools` (OpenAI-shaped) given to it."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        for m in messages:
            if m.role not in CHAT_ROLES:
                raise InvalidRequestError(f"unknown message role {m.role!r} ({', '.join(CHAT_ROLES)})", param="messages")
        template = self._template
        if template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        turns = [_turn(m, template.renders_tool_calls) for m in messages]
        if tools and not template.takes_tools:
            _add_system_note(turns, tool_note(list(tools), several_calls))
        try:
            return template.render(turns, tools=tools if template.takes_tools else None)
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc), param="messages") from None

    def encode_chat(self, messages: Sequence[generation_pb2.ChatMessage],
                    tools: Sequence[dict[str, Any]] = (), several_calls: bool = True) -> list[int]:
        return self._tokenizer.encode(self.render_chat(messages, tools, several_calls), add_special_tokens=False).ids

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone (for logprobs when decode sent none)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _turn(message: generation_pb2.ChatMessage, renders_tool_calls: bool) -> dict[str, Any]:
    """One message as the template sees it; calls the template would drop become text."""
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls and renders_tool_calls:
        turn["tool_calls"] = template_tool_calls(message.tool_calls)
    elif message.tool_calls:
        calls = calls_as_text(message.tool_calls)
        turn["content"] = f"{message.content}\n{calls}" if message.content else calls
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.name:
        turn["name"] = message.name
    return turn


def _add_system_note(turns: list[dict[str, Any]], note: str) -> None:
    if turns[0]["role"] == "system":
        turns[0]["content"] = f"{turns[0]['content']}\n\n{note}"
    else:
        turns.insert(0, {"role": "system", "content": note})


def check_raw_size(request: generation_pb2.GenerateRequest, max_model_len: int) -> None:
    """Before any work: the raw prompt must be able to fit the context."""
    which = request.WhichOneof("input")
    if which == "token_ids":
        if len(request.token_ids.ids) >= max_model_len:
            raise InvalidRequestError(f"the prompt has {len(request.token_ids.ids)} tokens; "
                                      f"this model's context is {max_model_len}", param="prompt", code="context_length_exceeded")
        return
    texts = [request.prompt] if which == "prompt" else [m.content for m in request.chat.messages]
    if which == "chat":
        texts += [c.arguments_json for m in request.chat.messages for c in m.tool_calls]
        texts += [t.parameters_json + t.description for t in request.tools]
    check_text_size(texts, max_model_len, "messages" if which == "chat" else "prompt")


def check_text_size(texts: Sequence[str], max_model_len: int, param: str) -> None:
    """Texts that cannot fit `max_model_len` tokens are refused before anyone tokenizes them."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if sum(len(t) for t in texts) > limit:
        raise InvalidRequestError(f"the prompt is over {limit} characters; this model's "
                                  f"context is {max_model_len} tokens", param=param, code="context_length_exceeded")


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raise INVALID_ARGUMENT when an id is outside [0, vocab_size)."""
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"token id {token_id} is outside the vocabulary (size {vocab_size})", param=param)

