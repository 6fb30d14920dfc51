"""`bench serve --workload multiturn`: its conversations (reproducible, history carried) and
its report (per-turn TTFT, cached tokens per tier, whole-history hits, text agreement)."""
from __future__ import annotations

import pytest

from pdserve.bench import serve
from pdserve.bench.multiturn import (
    MultiturnSpec,
    Turn,
    format_comparison,
    format_turns,
    history_cached,
    later_turns_ttft_p50_ms,
    session_id,
    summarize_turns,
    system_message,
    text_agreement,
    user_turn,
)
from pdserve.bench.report import RequestResult, request_from_json, to_jsonable
from pdserve.bench.stream import Endpoint, OpenAIStreamClient, _Trace
from pdserve.bench.workload import BenchConfigError, parse_length


def spec(**kw) -> MultiturnSpec:
    base = dict(num_sessions=3, num_turns=3, think_time_s=1.0, system_len=parse_length("400-600"),
                turn_len=parse_length("16-48"), output_len=parse_length("24"))
    return MultiturnSpec(**{**base, **kw})


def result(ttft_s: float, prompt: int | None, output: int, cached: int | None, text: str = "a",
           by_tier=(), success: bool = True) -> RequestResult:
    return RequestResult(index=0, class_name="turn", success=success, error="" if success else "boom", start_s=0.0,
                         ttft_s=ttft_s, e2e_s=ttft_s + 0.1, itl_s=(), output_tokens=output, prompt_tokens=prompt,
                         usage_reported=prompt is not None, num_chunks=output, finish_reason="length",
                         target_input_tokens=None, max_tokens=output, text_sha256=text, cached_tokens=cached,
                         cached_tokens_by_tier=by_tier)


def test_conversations_are_reproducible_and_sized_as_asked():
    a, b = spec(), spec()
    assert system_message(a, 1) == system_message(b, 1) != system_message(a, 2)
    assert 400 <= len(system_message(a, 0).content.split()) <= 600
    message, max_tokens, think = user_turn(a, 0, 2)
    assert user_turn(b, 0, 2) == (message, max_tokens, think)
    assert 16 <= len(message.content.split()) <= 48 and max_tokens == 24 and 0.5 <= think <= 1.5
    assert session_id(a, 0) != session_id(a, 1) and session_id(a, 0) != session_id(spec(seed=1), 0)
    with pytest.raises(BenchConfigError):
        spec(num_turns=0)


def test_per_turn_report_ttft_cached_tokens_and_whole_history_hits():
    turns = [
        Turn(0, 1, result(1.0, 500, 24, 0)), Turn(1, 1, result(2.0, 520, 24, 0)),
        # session 0 found its history (500 + 24 - 16 <= 510); session 1 fell a block short
        Turn(0, 2, result(0.2, 560, 24, 510, by_tier=(("device", 400), ("host", 110)))),
        Turn(1, 2, result(0.4, 580, 24, 527, by_tier=(("device", 527),))),
        Turn(0, 3, result(0.1, 600, 24, None)),  # no usage details: not judged
        Turn(1, 3, result(9.0, 0, 0, 0, success=False)),
    ]
    first, second, third = summarize_turns(turns, block_size=16)
    assert (first.turn, first.num_ok, first.num_sent, first.num_history_checked) == (1, 2, 2, 0)
    assert first.ttft_p50_ms == pytest.approx(1500) and first.ttft_p90_ms == pytest.approx(1900)
    assert (second.num_history_cached, second.num_history_checked) == (1, 2)
    assert second.mean_cached_tokens == pytest.approx(518.5)
    assert second.mean_cached_by_tier == (("device", 463.5), ("host", 55.0))
    assert (third.num_ok, third.num_sent, third.mean_cached_tokens, third.num_history_checked) == (1, 2, None, 0)
    assert later_turns_ttft_p50_ms(turns) == pytest.approx(200)
    table = format_turns([first, second, third])
    assert "1/2" in table and "device 464 (81%) host 55 (10%)" in table  # of turn 2's mean prompt, 570


def test_history_cached_needs_both_turns_reports():
    previous = result(1.0, 100, 20, 0)
    assert history_cached(previous, result(0.1, 130, 20, 104), 16) is True
    assert history_cached(previous, result(0.1, 130, 20, 103), 16) is False
    assert history_cached(result(1.0, None, 20, None), result(0.1, 130, 20, 200), 16) is None


def test_a_reencoded_answer_is_judged_on_the_tokens_shared():
    """The answer's text read back as other tokens from its 9th token on: 108 tokens can be
    cached at most, so 92 cached (108 less a block) is the whole history."""
    previous = result(1.0, 100, 20, 0)
    assert history_cached(previous, result(0.1, 130, 20, 92), 16, shared_tokens=108) is True
    assert history_cached(previous, result(0.1, 130, 20, 91), 16, shared_tokens=108) is False
    assert history_cached(previous, result(0.1, 130, 20, 103), 16, shared_tokens=125) is False  # all shared
    turns = [Turn(0, 1, previous), Turn(0, 2, result(0.1, 130, 20, 96), shared_tokens=108),
             Turn(1, 1, previous), Turn(1, 2, result(0.1, 130, 20, 112), shared_tokens=120)]
    second = summarize_turns(turns, block_size=16)[1]
    assert (second.num_history_cached, second.num_history_checked, second.num_reencoded) == (2, 2, 1)
    assert "turn 2: 1 previous answers came back as other tokens" in format_turns([second])


def test_text_agreement_and_comparison_between_two_servers():
    a = [Turn(0, 1, result(1.0, 10, 2, 0, "x")), Turn(0, 2, result(0.2, 20, 2, 10, "y")),
         Turn(1, 1, result(1.0, 10, 2, 0, "z"))]
    b = [Turn(0, 1, result(1.0, 10, 2, 0, "x")), Turn(0, 2, result(0.8, 20, 2, 0, "other")),
         Turn(1, 1, result(1.0, 10, 2, 0, "z", success=False))]
    assert text_agreement(a, b) == (1, 2)
    text = format_comparison("tiers", a, "plain", b)
    assert "same text 1 of 2" in text and "0.25x" in text


def test_usage_details_are_read_and_survive_json():
    client = OpenAIStreamClient(Endpoint("http://127.0.0.1:9/v1"))
    trace = _Trace()
    client._take_chunk('{"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3, '
                       '"prompt_tokens_details": {"cached_tokens": 32}}, '
                       '"pdserve": {"cached_tokens_by_tier": {"host": 16, "device": 16}}}', trace, 0.0)
    assert trace.cached == 32 and trace.cached_by_tier == (("device", 16), ("host", 16))
    r = result(0.1, 40, 3, 32, by_tier=trace.cached_by_tier)
    assert request_from_json(to_jsonable(r)) == r


def test_the_cli_refuses_a_mix_with_multiturn(capsys):
    assert serve.main(["--workload", "multiturn", "--mix", "a:1:10:10"]) == 2
    assert "multiturn" in capsys.readouterr().err
