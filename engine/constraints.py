"""Constrained decoding: the tokens a request may draw next, from a grammar (llguidance).

A request with a `Constraint` gets a `GrammarMatcher` at admission. Before each draw the
sampler masks every token the grammar does not allow; every token appended to the request
(sampled here, or the first token a prefill service chose) advances the matcher, so the
mask is the same on every path. Unconstrained requests carry `NO_GRAMMAR`, which allows
everything and costs nothing. llguidance is imported only when a constraint is first used.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy
import torch

from pdserve.common.errors import InvalidRequestError

MAX_SCHEMA_CHARS = 64 * 1024


KINDS = ("json_object", "json_schema", "llguidance")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must be: `json_object` (any JSON object), `json_schema` (JSON valid
    against `schema`, the schema's JSON text, as standard JSON Schema reads it: objects open
    unless they say otherwise) or `llguidance` (`schema` is an llguidance grammar, the text
    llguidance's grammar_from_* produce, JSON or Lark: the router's compiled form of every kind)."""

    kind: str
    schema: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown constraint {self.kind!r}")
        limit = MAX_SCHEMA_CHARS * (4 if self.kind == "llguidance" else 1)  # a grammar wraps a closed schema
        if len(self.schema) > limit:
            raise InvalidRequestError(f"the {self.kind} constraint is over {limit} characters")
        if self.kind == "json_schema":
            try:
                json.loads(self.schema)
            except ValueError as exc:
                raise InvalidRequestError(f"the {self.kind} constraint is not JSON: {exc}") from None

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (compact JSON for the JSON kinds)."""
        import llguidance

        if self.kind == "llguidance":
            return self.schema
        schema = self.schema if self.kind == "json_schema" else '{"type": "object"}'
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except Exception as exc:  # noqa: BLE001 - the library's message names the schema's fault
            raise InvalidRequestError(f"unsupported JSON schema: {exc}") from None


class NoGrammar:
    """The null matcher: every token allowed."""

    is_constrained = False

    def allowed(self) -> torch.Tensor | None:
        return None

    def advance(self, token_id: int) -> None:
        pass

    def num_valid(self, token_ids: list[int]) -> int:
        return len(token_ids)


NO_GRAMMAR = NoGrammar()


class GrammarMatcher:
    """One request's grammar state (an llguidance LLMatcher)."""

    is_constrained = True

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        # one byte per token: 0 (refused) or 200 (allowed)
        per_token = numpy.frombuffer(self._matcher.compute_logit_bias(), dtype=numpy.uint8)
        return torch.from_numpy(per_token[: self._vocab_size] != 0)  # numpy: one thread, no pool wake-up

    def advance(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)  # a refused token (EOS past the end) is harmless

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, from the first, the grammar accepts next (state unchanged)."""
        return self._matcher.validate_tokens(token_ids) if token_ids else 0


class GrammarCompiler:
    """Builds matchers for one tokenizer; the llguidance tokenizer is made once, lazily."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None

    def matcher(self, constraint: Constraint | None):
        if constraint is None:
            return NO_GRAMMAR
        import llguidance
        import llguidance.hf

        if self._hf_tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: constrained output needs one")
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids or None)
        grammar = constraint.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        if error and not error.startswith("WARNING"):
            what = "grammar" if constraint.kind == "llguidance" else "JSON schema"
            raise InvalidRequestError(f"unsupported {what}: {error}")
        return GrammarMatcher(llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0), self._vocab_size)
