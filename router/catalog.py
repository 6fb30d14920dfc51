"""The models the router serves: name -> model facts and the prompt builder.

A model becomes known when its first decode worker registers: the router calls that
worker's ModelInfo (with the tokenizer) once. Later decode workers of the same model reuse
it, unless none of the earlier ones is still alive (then the newcomer's answer replaces it).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.common.errors import IncompatiblePeerError, InvalidRequestError, NotFoundError, UnavailableError
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.prompt import PromptBuilder


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    info: common_pb2.ModelInfoResponse  # as the worker answered, tokenizer_json included
    prompts: PromptBuilder
    created_unix: int  # when the router learned it (OpenAI's "created")

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def block_hash_salt(self) -> int:
        return self.info.block_hash_salt


# What a model's first ModelInfo pins (security: routing can't be captured by one worker).
PINNED_FIELDS = ("tokenizer_json", "chat_template", "bos_token", "eos_token", "eos_token_ids", "vocab_size",
                 "block_hash_salt", "special_tokens", "additional_special_tokens")


def _pinned(info: common_pb2.ModelInfoResponse) -> tuple:
    return tuple(dict(value) if name == "special_tokens" else
                 (tuple(value) if not isinstance(value, (str, bytes, int)) else value)
                 for name in PINNED_FIELDS for value in (getattr(info, name),))


class ModelCatalog:
    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def names(self) -> list[str]:
        return sorted(self._models)

    def models(self) -> list[ServedModel]:
        return [self._models[name] for name in self.names()]

    def knows(self, name: str) -> bool:
        return name in self._models

    async def learn(self, info: common_pb2.ModelInfoResponse) -> ServedModel:
        """Add or replace a model from a worker's ModelInfo answer (tokenizer included). How
        a model turns text into tokens (`PINNED_FIELDS`) is pinned by its first answer: a
        later one that disagrees is refused (FAILED_PRECONDITION), so no registrant can
        install its own tokenizer or chat template for every client of a model."""
        if not info.model_name:
            raise InvalidRequestError("ModelInfo has no model_name")
        known = self._models.get(info.model_name)
        if known is not None and _pinned(known.info) != _pinned(info):
            raise IncompatiblePeerError(f"ModelInfo of {info.model_name!r} disagrees with the tokenizer or chat "
                                        "template this router pinned for it (restart the router to change them)")
        if info.max_model_len < 2 or info.block_size < 1:
            raise InvalidRequestError(f"ModelInfo of {info.model_name!r}: bad max_model_len/block_size")
        try:  # parsing tokenizer.json takes a while: off the event loop
            prompts = await asyncio.to_thread(PromptBuilder.from_model_info, info)
        except ValueError as exc:
            raise InvalidRequestError(f"ModelInfo of {info.model_name!r}: {exc}") from None
        model = ServedModel(info.model_name, info, prompts, int(time.time()))
        self._models[model.name] = model
        return model

    def resolve(self, name: str) -> ServedModel:
        """The model a request names: NOT_FOUND if unknown, UNAVAILABLE if none is known
        yet, the only model when the name is empty."""
        if not self._models:
            raise UnavailableError("no model is served yet (no decode worker has registered)")
        if not name:
            if len(self._models) == 1:
                return next(iter(self._models.values()))
            raise InvalidRequestError("model is required when several are served",
                                      param="model")
        model = self._models.get(name)
        if model is None:
            raise NotFoundError(f"The model `{name}` does not exist", param="model")
        return model
