"""Speculative decoding by prompt lookup: drafts copied from the sequence itself, checked in
the step that would have computed one token.

Proposal: a decoding sequence whose last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) occurred earlier in its prompt or output gets, as drafts, the tokens
that followed the latest such occurrence (`propose`). The search looks back at most
LOOKUP_WINDOW tokens: it runs on the engine thread for every speculating sequence of every
step, outside the step cost model, so its cost must not grow with a client's context.

Verification: the step computes the sequence's last token and its drafts as consecutive
decode rows; row i is position `start + i` and attends to positions <= `start + i`, so its
logits are those a plain step at that position computes. The engine samples the rows in
order, each exactly as a plain step samples it (penalties, seed index, grammar and stop state
after the tokens before it), and goes on while the sampled token equals the draft. The output
is therefore the output without speculation, token for token, greedy or seeded; unseeded
sampling keeps the model's distribution (a draft is kept with the probability the model gives
it, the same acceptance as rejection sampling against a one-token proposal). A rejected
draft's KV slot is rewritten by a later step; blocks past the kept tokens go back at once.

Whether it pays is decided per step, for the whole batch (`Speculator.plan`): a step costs
about `a + b * rows` (`StepCost`, fitted online from the engine's own decode steps), and a
draft runs only while it lowers the mean time per token of the step's sequences
(`choose_drafts`): a lone stream speculates whenever its tokens per second rise, a full batch
only on drafts nearly sure to be kept. Each sequence's chance is its recent keep rate; a
sequence whose drafts keep failing stops speculating and is probed again as its evidence ages.

The engine's one collaborator for all of it is a `Speculator` (or `NO_SPECULATION`): the
scheduler asks it to attach drafts to a planned step (`add_drafts`) and then sees only the
draft tokens on the chunks; the engine hands it the step's logits (`sample`) and gets the
step's token deltas back, whether or not drafts were checked.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.outputs import RequestOutput, merge_deltas
from pdserve.engine.request import Request
from pdserve.engine.sampler import SampledToken, sample

if TYPE_CHECKING:
    from pdserve.engine.kv_cache_manager import KVCacheManager
    from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput

# the engine's recorder of sampled tokens: (request, token id, logprob) items in, their
# token deltas out (none for a request that had finished already)
Record = Callable[[list], list[RequestOutput]]

PRIOR_KEPT, PRIOR_TESTED = 1.0, 2.0  # a sequence's keep rate starts at 1/2
EVIDENCE_DECAY = 0.9  # per verification: about the last 10 drafts tested count
SKIPPED_DECAY = 0.99  # per step a proposal was not run: a failing sequence is probed again
LOOKUP_WINDOW = 8192  # tokens a proposal searches, the newest: its cost per step is bounded


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int, window: int = LOOKUP_WINDOW) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens`, for the largest n in [min_n, max_n] that occurs within the last `window`
    tokens; empty when none does."""
    tokens = tokens[-window:]
    length = tokens.shape[0]
    if length < 2:
        return tokens[:0]
    # ends of the occurrences of the last n tokens, n = 1, 2, ...; an end p <= length - 2
    # leaves a token to propose after it
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    best, n = -1, 1
    while ends.size:
        if n >= min_n:
            best = int(ends[-1])
        if n == max_n:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
        n += 1
    return tokens[best + 1:best + 1 + k] if best >= 0 else tokens[:0]


class TokenHistory:
    """A sequence's prompt and output tokens as one growing int32 array."""

    __slots__ = ("_buffer", "num_tokens")

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.int32)
        self.num_tokens = 0

    def sync(self, request: Request) -> np.ndarray:
        """The request's tokens (its prompt, then its output), appending what is new."""
        total = request.num_tokens
        if total > self._buffer.shape[0]:
            grown = np.empty(max(256, 2 * total), dtype=np.int32)
            grown[:self.num_tokens] = self._buffer[:self.num_tokens]
            self._buffer = grown
        if self.num_tokens == 0:
            self._buffer[:total] = request.prompt_token_ids + request.output_token_ids
        else:
            for position in range(self.num_tokens, total):
                self._buffer[position] = request.token_id_at(position)
        self.num_tokens = total
        return self._buffer[:total]


@dataclass(slots=True)
class SequenceDrafts:
    """One sequence's speculation: its token history, its keep-rate evidence (decayed) and
    its totals (reported with its usage)."""

    history: TokenHistory
    kept: float = 0.0
    tested: float = 0.0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_steps: int = 0

    @property
    def keep_rate(self) -> float:
        """The chance a draft is kept, given the drafts before it were."""
        return (self.kept + PRIOR_KEPT) / (self.tested + PRIOR_TESTED)

    def observe(self, num_drafts: int, num_kept: int, num_tested: int) -> None:
        self.kept = self.kept * EVIDENCE_DECAY + num_kept
        self.tested = self.tested * EVIDENCE_DECAY + num_tested
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_kept
        self.num_draft_steps += 1

    def skipped(self) -> None:
        self.kept *= SKIPPED_DECAY
        self.tested *= SKIPPED_DECAY


class StepCost:
    """A decode step's time as `a + b * rows`, fitted by least squares over the engine's
    recent decode-only steps (exponential forgetting). `ratio` is b / a: one more row's cost
    in units of a one-row step's fixed part."""

    FORGET = 0.99
    PRIOR_RATIO = 0.2  # until the steps seen differ in rows (CPU here: 0.15-0.25)
    MIN_SPREAD = 0.25  # variance of the rows seen below which the fit is not trusted

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def note(self, rows: int, seconds: float) -> None:
        f = self.FORGET
        self._w = self._w * f + 1.0
        self._x = self._x * f + rows
        self._y = self._y * f + seconds
        self._xx = self._xx * f + rows * rows
        self._xy = self._xy * f + rows * seconds

    @property
    def ratio(self) -> float:
        if self._w == 0.0:
            return self.PRIOR_RATIO
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var < self.MIN_SPREAD:
            return self.PRIOR_RATIO
        b = (self._xy / self._w - mean_x * mean_y) / var
        a = mean_y - b * mean_x
        if a <= 0.0:
            return 2.0  # rows dominate: a draft must be nearly sure
        return min(2.0, max(0.001, b / a))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A decoding sequence that could carry `drafts` this step, kept each with `keep_rate`
    given the ones before."""

    index: int  # its chunk's place in the step
    drafts: tuple[int, ...]
    keep_rate: float


def choose_drafts(candidates: Sequence[Candidate], ratio: float, num_rows: int, num_samples: int,
                  max_rows: int) -> dict[int, int]:
    """How many of its drafts each candidate runs (by chunk index; absent: none), minimising
    the mean time per token of the step's sequences, T * sum(1 / n_s): a step of R rows takes
    T = 1 + ratio * R units, and sequence s gives n_s tokens (1 and its kept drafts; draft j
    of a candidate is kept with chance keep_rate**j). A draft shortens its own sequence's time
    per token and lengthens every other's by a row: drafts go in, the largest drop in
    sum(1 / n_s) first, while the drop outweighs the row. One sequence alone: its tokens per
    unit of time; many: a draft must be nearly sure, so no sequence pays much for another's."""
    heap = [(-c.keep_rate / (1.0 + c.keep_rate), i, 1, c.keep_rate, 1.0) for i, c in enumerate(candidates) if c.drafts]
    heapq.heapify(heap)
    time, inverse = 1.0 + ratio * num_rows, float(num_samples)  # T and sum(1 / n_s)
    taken: dict[int, int] = {}
    rows = num_rows
    while heap and rows < max_rows:
        neg_drop, i, j, chance, tokens = heapq.heappop(heap)
        drop = -neg_drop
        if drop * (time + ratio) <= ratio * inverse:
            break  # (T + ratio)(H - drop) >= T H: this draft, and every later one, costs more than it gives
        time += ratio
        rows += 1
        inverse -= drop
        tokens += chance
        candidate = candidates[i]
        taken[candidate.index] = j
        if j < len(candidate.drafts):
            chance *= candidate.keep_rate
            heapq.heappush(heap, (-chance / (tokens * (tokens + chance)), i, j + 1, chance, tokens))
    return taken


class NoSpeculation:
    """Speculation off: no step carries drafts; a step's logits are sampled in one batch.
    The contract every speculator keeps (`Speculator` extends it): `add_drafts` may put
    drafts on decoding chunks of a planned step, holding their blocks; `sample` takes the
    step's sampling chunks and logits, records each token through `record` in order, and
    returns the deltas; `note_step` hears each forward's time."""

    num_draft_tokens = num_accepted_tokens = num_verified_sequences = 0

    def totals(self) -> tuple[int, int, int]:
        """(drafts checked, drafts kept, sequence-steps that checked drafts), all requests."""
        return self.num_draft_tokens, self.num_accepted_tokens, self.num_verified_sequences

    def add_drafts(self, chunks: list[ScheduledChunk], max_num_tokens: int) -> None:
        pass

    def sample(self, chunks: list[ScheduledChunk], logits, record: Record) -> list[RequestOutput]:
        """Each chunk's token from its row of `logits`, recorded; returns the deltas."""
        requests = [c.request for c in chunks]
        return record([(r, t.token_id, t.logprob) for r, t in zip(requests, sample(logits, requests))])

    def note_step(self, step: SchedulerOutput, seconds: float) -> None:
        pass


NO_SPECULATION = NoSpeculation()


class Speculator(NoSpeculation):
    """The engine's speculative decoding: drafts for a planned step (and the blocks they are
    computed in), their verification, and what it found. Used on the engine's thread only."""

    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.cost = StepCost()
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verified_sequences = 0  # sequence-steps that carried drafts

    def state(self, request: Request) -> SequenceDrafts:
        if request.speculation is None:
            request.speculation = SequenceDrafts(TokenHistory())
        return request.speculation

    def candidates(self, chunks, room: int, floor: float) -> list[Candidate]:
        """The decoding chunks of a step with their proposals (at most `room` drafts each).
        A sequence whose keep rate is at most `floor` is not searched (its evidence ages)."""
        c = self.config
        out: list[Candidate] = []
        for index, chunk in enumerate(chunks):
            request = chunk.request
            if chunk.num_new_tokens != 1 or request.num_output_tokens == 0 or not chunk.samples_token:
                continue
            left = request.final_length - request.num_tokens - 1  # a draft stays below the final length
            k = min(c.num_speculative_tokens, left, room)
            if k <= 0:
                continue
            state = self.state(request)
            if state.keep_rate <= floor:
                state.skipped()
                continue
            drafts = propose(state.history.sync(request), c.prompt_lookup_min, c.prompt_lookup_max, k)
            drafts = tuple(int(t) for t in drafts[:request.grammar.num_valid(drafts.tolist())])
            if drafts:
                out.append(Candidate(index, drafts, state.keep_rate))
        return out

    def plan(self, chunks: list, num_rows: int, max_rows: int) -> dict[int, tuple[int, ...]]:
        """Drafts to run this step, by chunk index, for a step of `num_rows` rows that may
        grow to `max_rows`."""
        num_decoding = sum(1 for chunk in chunks if chunk.num_new_tokens == 1)
        limit = self.config.disable_by_batch_size
        if limit and num_decoding >= limit:
            return {}
        ratio = self.cost.ratio
        num_samples = sum(1 for chunk in chunks if chunk.samples_token)
        # what a first draft's chance p must beat: p / (1 + p) > ratio * H / (T + ratio), H = num_samples
        share = ratio * num_samples / (1.0 + ratio * (num_rows + 1))
        floor = share / (1.0 - share) if share < 1.0 else 1.0
        candidates = self.candidates(chunks, max_rows - num_rows, floor)
        taken = choose_drafts(candidates, ratio, num_rows, num_samples, max_rows)
        for candidate in candidates:
            if candidate.index not in taken:
                chunks[candidate.index].request.speculation.skipped()
        return {c.index: c.drafts[:taken[c.index]] for c in candidates if c.index in taken}

    def observe(self, request: Request, num_drafts: int, num_kept: int, num_tested: int) -> None:
        self.state(request).observe(num_drafts, num_kept, num_tested)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_kept
        self.num_verified_sequences += 1

    # -- the engine's side: attach drafts to a planned step, check them after its forward --
    def add_drafts(self, chunks: list[ScheduledChunk], max_num_tokens: int) -> None:
        """Drafts, on the decoding chunks `plan` picks, in blocks the pool has free now (a
        draft never preempts; its blocks go back after verification, `kv.trim`). A draft's
        position stays below the request's final length, so its blocks are within what
        admission reserved for it."""
        if not chunks:
            return
        num_rows = sum(c.num_rows for c in chunks)
        for index, drafts in self.plan(chunks, num_rows, max(num_rows, max_num_tokens)).items():
            chunk = chunks[index]
            if self.kv.prepare_resources(chunk.request, 1 + len(drafts)):
                chunks[index] = dataclasses.replace(chunk, draft_token_ids=drafts)

    def sample(self, chunks: list[ScheduledChunk], logits, record: Record) -> list[RequestOutput]:
        """Sample each chunk's rows of `logits` (`StepResult.logits`): one batch for the
        chunks without drafts, then each chunk with drafts in order of its rows (`verify`).
        A checked chunk keeps the KV of its kept drafts, gives back the blocks past them and
        sends its tokens as one delta, which counts this verification in its usage."""
        firsts = list(itertools.accumulate((1 + len(c.draft_token_ids) for c in chunks), initial=0))
        plain = [i for i, c in enumerate(chunks) if not c.draft_token_ids]
        deltas: list[RequestOutput] = []
        if plain:
            rows = logits if len(plain) == len(chunks) else logits[[firsts[i] for i in plain]]
            deltas += super().sample([chunks[i] for i in plain], rows, record)
        for i, chunk in enumerate(chunks):
            if not chunk.draft_token_ids:
                continue
            request, mine = chunk.request, []
            num_kept, num_tested = verify(request, chunk.draft_token_ids, logits[firsts[i]:firsts[i + 1]],
                                          lambda token: mine.extend(record([(request, token.token_id, token.logprob)])))
            request.num_computed_tokens += num_kept
            self.observe(request, len(chunk.draft_token_ids), num_kept, num_tested)
            if not request.is_finished:
                self.kv.trim(request)
            if mine:  # its usage as of this verification, which its deltas were built before
                state = request.speculation
                deltas.append(dataclasses.replace(
                    merge_deltas(mine), num_draft_tokens=state.num_draft_tokens,
                    num_accepted_tokens=state.num_accepted_tokens, num_draft_steps=state.num_draft_steps))
        return deltas

    def note_step(self, step: SchedulerOutput, seconds: float) -> None:
        """A step's forward took `seconds`: a decode-only one refines the step cost."""
        if all(c.num_new_tokens == 1 for c in step.chunks):
            self.cost.note(step.num_tokens, seconds)


def verify(request: Request, drafts: Sequence[int], logits, append: Callable[[SampledToken], None]) -> tuple[int, int]:
    """Sample `logits`' rows (one per position: the request's next token, then after each
    draft) in order, each as a plain step samples its position, and `append` each token,
    while the token drawn is the draft there. Returns (drafts kept, drafts tested)."""
    num_kept = num_tested = 0
    for i in range(len(drafts) + 1):
        token = sample(logits[i:i + 1], [request])[0]
        append(token)
        if i == len(drafts):
            break
        num_tested += 1
        if token.token_id != drafts[i]:
            break
        num_kept += 1
        if request.is_finished:
            break
    return num_kept, num_tested
