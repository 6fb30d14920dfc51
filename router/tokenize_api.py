"""/tokenize and /detokenize (vLLM's request and response shapes), on the router's own
tokenizer and chat template: no worker is involved.

/tokenize: {"model"?, "prompt", "add_special_tokens"=true} or {"model"?, "messages",
"add_generation_prompt"=true (always), "add_special_tokens"=false}, optional
"return_token_strs" -> {"count", "max_model_len", "tokens", "token_strs"}.
/detokenize: {"model"?, "tokens": [ids]} -> {"prompt"}.
"""
from __future__ import annotations

from typing import Any

from pdserve.common.errors import InvalidRequestError, ServiceError
from pdserve.router.catalog import ModelCatalog, ServedModel
from pdserve.router.openai_request import chat_messages


def _invalid(message: str, param: str) -> ServiceError:
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
        text = prompts.render_chat(chat_messages(body["messages"]))
        ids = prompts.encode_text(text, _flag(body, "add_special_tokens", False))
    elif isinstance(body.get("prompt"), str):
        ids = prompts.encode_text(body["prompt"], _flag(body, "add_special_tokens", True))
    else:
        raise _invalid("give 'prompt' (a string) or 'messages'", "prompt")
    strs = prompts.token_strs(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(catalog: ModelCatalog, body: dict[str, Any]) -> dict[str, Any]:
    model = _model(catalog, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _invalid("'tokens' must be a list of token ids", "tokens")
    return {"prompt": model.prompts.decode(tokens)}
