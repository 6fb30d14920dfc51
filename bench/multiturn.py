"""`pdserve bench serve --workload multiturn`: chats that come back.

N sessions run at once, each T turns: a system message of `--system-len` words, then per
turn a user message of `--turn-len` words; each answer is appended to the history before the
next turn, which is sent after a think time. The session id goes as `user` (what a router's
session affinity and a tiered KV cache key on). Session s, turn t's words depend only on
(seed, s, t), so two servers get the same conversations as long as they answer alike
(greedy sampling); with `--compare-url` both are run, one after the other.

What it reports, per turn index: TTFT p50/p90, mean prompt and cached tokens (and per tier
where the server says: pdserve's `cached_tokens_by_tier`, for an admin key), and how many
turns found their whole history
cached (at least the previous turn's prompt plus answer, less one block); with two servers,
how many turns answered the same text, and the TTFT p50 of turns >= 2 of each.

A history is judged by the tokens it can share with the turn before: an answer sent back as
text is tokenized again with the new prompt, and a tokenizer may split that text otherwise
than the model generated it (e.g. " 1" "2" generated, " 12" read back). No cache can serve
tokens from the first difference on, so where the server gives both the answer's ids (vLLM's
return_tokens_as_token_ids) and the new prompt's (its /tokenize), a turn needs its shared
prefix cached (less one block), and the report counts the answers that were re-encoded.

    pdserve bench serve --workload multiturn --sessions 8 --turns 4 --output-len 24 \\
        --ignore-eos --base-url http://127.0.0.1:8000/v1 --compare-url http://127.0.0.1:8100/v1
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from pdserve.bench.report import RequestResult, percentile
from pdserve.bench.stream import Endpoint, OpenAIStreamClient
from pdserve.bench.workload import BenchConfigError, BenchRequest, LengthDist, Message, synthetic_text


@dataclass(frozen=True, slots=True)
class MultiturnSpec:
    num_sessions: int
    num_turns: int
    think_time_s: float  # mean pause between an answer and the next turn (uniform over 0.5x-1.5x)
    system_len: LengthDist  # words of the system message
    turn_len: LengthDist  # words of each user message
    output_len: LengthDist  # max_tokens of each turn
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.num_turns < 1:
            raise BenchConfigError("sessions and turns must be >= 1")
        if not self.think_time_s >= 0:
            raise BenchConfigError("think time must be >= 0")


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn's measurement."""

    session: int
    turn: int  # 1-based
    result: RequestResult
    # tokens of this prompt equal to the previous turn's prompt + answer ids (None: unknown)
    shared_tokens: int | None = None


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def session_id(spec: MultiturnSpec, session: int) -> str:
    return f"bench-{spec.seed}-session-{session}"


def _rng(spec: MultiturnSpec, session: int, turn: int) -> random.Random:
    return random.Random(f"pdserve-multiturn:{spec.seed}:{session}:{turn}")


def system_message(spec: MultiturnSpec, session: int) -> Message:
    rng = _rng(spec, session, 0)
    return Message("system", synthetic_text(spec.system_len.sample(rng), rng))


def user_turn(spec: MultiturnSpec, session: int, turn: int) -> tuple[Message, int, float]:
    """Turn `turn`'s user message, its max_tokens, and the think time before it."""
    rng = _rng(spec, session, turn)
    message = Message("user", synthetic_text(spec.turn_len.sample(rng), rng))
    return message, spec.output_len.sample(rng), spec.think_time_s * rng.uniform(0.5, 1.5)


async def run_session(client: OpenAIStreamClient, spec: MultiturnSpec, session: int, start: float) -> list[Turn]:
    """The session's turns, each after the previous answer and a think time; a failed turn
    ends the session (the history the next turn needs is missing)."""
    history = [system_message(spec, session)]
    turns = []
    before: list[int] | None = None  # the previous turn's prompt + answer ids, where known
    for t in range(1, spec.num_turns + 1):
        message, max_tokens, think_s = user_turn(spec, session, t)
        if t > 1:
            await asyncio.sleep(think_s)
        history.append(message)
        prompt_ids = await client.tokenize_chat(history)
        request = BenchRequest(session * spec.num_turns + t - 1, f"turn{t}", tuple(history), max_tokens, None)
        result, text, answer_ids = await client.send_for_answer(request, start, user=session_id(spec, session),
                                                                token_ids=True)
        shared = shared_prefix(before, prompt_ids) if before is not None and prompt_ids is not None else None
        turns.append(Turn(session, t, result, shared))
        if not result.success:
            break
        before = prompt_ids + answer_ids if prompt_ids is not None and answer_ids is not None else None
        history.append(Message("assistant", text))
    return turns


async def run_multiturn(endpoint: Endpoint, spec: MultiturnSpec) -> tuple[str, list[Turn]]:
    """Every session against `endpoint`, all at once (each starts after a think time)."""
    async with OpenAIStreamClient(endpoint, max_connections=max(64, spec.num_sessions)) as client:
        model = await client.ensure_model()
        start = time.perf_counter()
        sessions = await asyncio.gather(*(run_session(client, spec, s, start) for s in range(spec.num_sessions)))
    return model, sorted((t for turns in sessions for t in turns), key=lambda t: (t.turn, t.session))


# ---------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class TurnSummary:
    turn: int
    num_ok: int
    num_sent: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    mean_prompt_tokens: float | None
    mean_cached_tokens: float | None  # None: the server reported no cached tokens
    mean_cached_by_tier: tuple[tuple[str, float], ...]
    num_history_cached: int  # turns >= 2 whose cached tokens cover the previous prompt + answer, less a block
    num_history_checked: int  # turns >= 2 where that could be judged (both turns reported usage)
    num_reencoded: int = 0  # turns >= 2 whose previous answer came back as other tokens


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def history_cached(previous: RequestResult, current: RequestResult, block_size: int,
                   shared_tokens: int | None = None) -> bool | None:
    """Whether `current` found its history cached: at least `previous`'s prompt plus answer,
    or of those the `shared_tokens` its prompt starts with where known, less one block. None
    when either turn did not report what it takes to judge."""
    if previous.prompt_tokens is None or current.cached_tokens is None or not previous.usage_reported:
        return None
    history = previous.prompt_tokens + previous.output_tokens
    if shared_tokens is not None:
        history = min(history, shared_tokens)
    return current.cached_tokens >= history - block_size


def reencoded(previous: RequestResult, shared_tokens: int | None) -> bool:
    """The previous answer came back as other tokens (the shared prefix ends inside it)."""
    if shared_tokens is None or previous.prompt_tokens is None or not previous.usage_reported:
        return False
    return shared_tokens < previous.prompt_tokens + previous.output_tokens


def summarize_turns(turns: Sequence[Turn], block_size: int = 16) -> list[TurnSummary]:
    by_turn: dict[int, list[Turn]] = defaultdict(list)
    by_key = {(t.session, t.turn): t.result for t in turns}
    for t in turns:
        by_turn[t.turn].append(t)
    out = []
    for index in sorted(by_turn):
        ok = [t.result for t in by_turn[index] if t.result.success]
        ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        tiers: dict[str, list[int]] = defaultdict(list)
        for r in ok:
            for tier, n in r.cached_tokens_by_tier:
                tiers[tier].append(n)
        returning = [t for t in by_turn[index] if t.result.success and (t.session, index - 1) in by_key]
        verdicts = [history_cached(by_key[(t.session, index - 1)], t.result, block_size, t.shared_tokens)
                    for t in returning]
        judged = [v for v in verdicts if v is not None]
        out.append(TurnSummary(
            index, len(ok), len(by_turn[index]),
            percentile(ttfts, 50) if ttfts else None, percentile(ttfts, 90) if ttfts else None,
            _mean([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
            _mean([r.cached_tokens for r in ok if r.cached_tokens is not None]),
            tuple((tier, sum(ns) / len(ok)) for tier, ns in sorted(tiers.items())),
            sum(judged), len(judged),
            sum(reencoded(by_key[(t.session, index - 1)], t.shared_tokens) for t in returning)))
    return out


def later_turns_ttft_p50_ms(turns: Sequence[Turn]) -> float | None:
    """TTFT p50 of every successful turn >= 2 (what a returning chat waits)."""
    ttfts = [t.result.ttft_s * 1000 for t in turns if t.turn >= 2 and t.result.success and t.result.ttft_s is not None]
    return percentile(ttfts, 50) if ttfts else None


def text_agreement(a: Sequence[Turn], b: Sequence[Turn]) -> tuple[int, int]:
    """(turns with the same text, turns both servers answered)."""
    texts = {(t.session, t.turn): t.result.text_sha256 for t in b if t.result.success}
    both = [t for t in a if t.result.success and (t.session, t.turn) in texts]
    return sum(1 for t in both if t.result.text_sha256 == texts[(t.session, t.turn)]), len(both)


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_turns(summaries: Sequence[TurnSummary]) -> str:
    head = (f"{'turn':>4} {'ok/sent':>8} {'TTFT p50':>9} {'p90':>8} {'prompt':>7} {'cached':>7} "
            f"{'history cached':>15}  cached by tier")
    rows = [head, "-" * len(head)]
    for s in summaries:
        history = f"{s.num_history_cached}/{s.num_history_checked}" if s.num_history_checked else "-"
        tiers = " ".join(f"{tier} {n:.0f}" + (f" ({n / s.mean_prompt_tokens:.0%})" if s.mean_prompt_tokens else "")
                         for tier, n in s.mean_cached_by_tier) or "-"
        rows.append(f"{s.turn:>4} {f'{s.num_ok}/{s.num_sent}':>8} {_fmt(s.ttft_p50_ms):>9} {_fmt(s.ttft_p90_ms):>8} "
                    f"{_fmt(s.mean_prompt_tokens):>7} {_fmt(s.mean_cached_tokens):>7} {history:>15}  {tiers}")
    rows += [f"turn {s.turn}: {s.num_reencoded} previous answers came back as other tokens (judged on the "
             "tokens shared)" for s in summaries if s.num_reencoded]
    return "\n".join(rows)


def format_comparison(label_a: str, a: Sequence[Turn], label_b: str, b: Sequence[Turn]) -> str:
    same, both = text_agreement(a, b)
    pa, pb = later_turns_ttft_p50_ms(a), later_turns_ttft_p50_ms(b)
    ratio = f"{pa / pb:.2f}x" if pa and pb else "-"
    return (f"same text {same} of {both} turns answered by both\n"
            f"TTFT p50 of turns >= 2: {label_a} {_fmt(pa)} ms, {label_b} {_fmt(pb)} ms ({ratio} of {label_b}'s)")


# ---------------------------------------------------------------- CLI (flags: bench.serve's parser)


def spec_from_args(args) -> MultiturnSpec:
    from pdserve.bench.workload import parse_length

    if args.mix or args.dataset:
        raise BenchConfigError("--workload multiturn makes its own conversations: no --mix or --dataset")
    return MultiturnSpec(args.sessions, args.turns, args.think_time_s, parse_length(args.system_len),
                         parse_length(args.turn_len), parse_length(args.output_len), args.seed)


def main_multiturn(args, endpoints: Sequence[Endpoint]) -> int:
    """Run the sessions against each endpoint in turn, print the report, write the JSON."""
    import json
    import sys
    from pathlib import Path

    from pdserve.bench.report import to_jsonable

    spec = spec_from_args(args)
    results = []
    for endpoint in endpoints:
        model, turns = asyncio.run(run_multiturn(endpoint, spec))
        results.append(turns)
        print(f"model {model} at {endpoint.base_url}: {spec.num_sessions} sessions x {spec.num_turns} turns, "
              f"system {spec.system_len} words, turns {spec.turn_len} words, answers {spec.output_len} tokens")
        print(format_turns(summarize_turns(turns, args.block_size)))
        failed = [t.result.error for t in turns if not t.result.success]
        if failed:
            print(f"{len(failed)} turns failed, e.g. {failed[0]}", file=sys.stderr)
    if len(results) == 2:
        print(format_comparison(endpoints[0].base_url, results[0], endpoints[1].base_url, results[1]))
    if args.out_dir:
        path = Path(args.out_dir) / "multiturn_results.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"spec": to_jsonable(spec), "servers": [
            {"base_url": e.base_url, "turns": [to_jsonable(t) for t in turns],
             "per_turn": [to_jsonable(s) for s in summarize_turns(turns, args.block_size)]}
            for e, turns in zip(endpoints, results)]}
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path}")
    return 0 if all(any(t.result.success for t in turns) for turns in results) else 1
