"""/tokenize and /detokenize (vLLM's request and response shapes), on the router's own
tokenizer and chat template: no worker is involved.

/tokenize: {"model"?, "prompt", "add_special_tokens"=true} or {"model"?, "messages",
"add_generation_prompt"=true (always), "add_special_tokens"=false}, optional
"return_token_strs" -> {"count", "max_model_len", "tokens", "token_strs"}.
/detokenize: {"model"?, "tokens": [ids]} -> {"prompt"}.
"""
from __future__ import annotations

from typing import Any

from pdserve.common.errors import InvalidRequestError
from pdserve.router.catalog import ModelCatalog, ServedModel
from pdserve.router.openai_request import chat_messages
from pdserve.router.prompt import check_text_size


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _model(catalog: ModelCatalog, body: dict[str, Any]) -> ServedModel:
    name = body.get("model")
    if name is None:
        names = catalog.names()
        if len(names) != 1:
            raise _invalid("'model' is required when the router serves several models (or none yet)", "model")
        name = names[0]
    if not isinstance(name, str):
        raise _invalid("'model' must be a string", "model")
    return catalog.resolve(name)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _invalid(f"'{name}' must be true or false", name)
    return value


def tokenize(catalog: ModelCatalog, body: dict[str, Any]) -> dict[str, Any]:
    model = _model(catalog, body)
    prompts = model.prompts
    if "messages" in body:
        messages = chat_messages(body["messages"])
        check_text_size([m.content for m in messages], model.max_model_len, "messages")
        text = prompts.render_chat(messages)
        ids = prompts.encode_text(text, _flag(body, "add_special_tokens", False))
    elif isinstance(body.get("prompt"), str):
        check_text_size([body["prompt"]], model.max_model_len, "prompt")  # as generation does
        ids = prompts.encode_text(body["prompt"], _flag(body, "add_special_tokens", True))
    else:
        raise _invalid("give 'prompt' (a string) or 'messages'", "prompt")
    strs = prompts.token_strs(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(catalog: ModelCatalog, body: dict[str, Any]) -> dict[str, Any]:
    model = _model(catalog, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise _invalid("'tokens' must be a list of token ids", "tokens")
    if len(tokens) > model.max_model_len:  # no prompt or answer of this model is longer
        raise _invalid(f"at most {model.max_model_len} tokens (this model's context)", "tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _invalid("'tokens' must be a list of token ids", "tokens")
    return {"prompt": model.prompts.decode(tokens)}
