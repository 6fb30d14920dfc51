"""Incremental detokenization with stop strings held back until they can no longer match."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Detokenizer:
    """Per-request text state. `push` returns the text that is safe to emit now."""

    tokenizer: object | None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded text so far (may end in a held-back tail)
    emitted: int = 0  # chars of `text` already returned
    stopped_by: str | None = None

    def push(self, token_id: int) -> str:
        """Add a token; return newly final text. Sets `stopped_by` when a stop string appears."""
        if self.tokenizer is None:
            return ""
        self.token_ids.append(token_id)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        self.text = full
        if self.stop:
            search_from = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [(self.text.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, s = min(hits)
                self.stopped_by = s
                self.text = self.text[:idx]
                return self.flush()
            hold = self._stop_prefix_len()
            safe = max(self.emitted, len(self.text) - hold)
            delta, self.emitted = self.text[self.emitted:safe], safe
            return delta
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string:
        that tail could still become a stop string, so it is not emitted yet."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end: whatever was held back."""
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
