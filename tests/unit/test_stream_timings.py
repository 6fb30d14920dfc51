"""The timings a migrated stream reports (`router.stream_timings`), on a fake clock: the phases
stay the request's first token's, the stall the client saw is `migration_ms`, and the new
decode's recompute of prompt and sent tokens is `resume_prefill_ms`, a part of that stall."""
from __future__ import annotations

from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.stream_timings import StreamTimings
from support import FakeClock

FIRST = common_pb2.RequestTimings(queue_ms=5.0, prefill_ms=100.0, transfer_ms=2.0, first_decode_ms=3.0)
RESUMED = common_pb2.RequestTimings(queue_ms=10.0, prefill_ms=400.0, first_decode_ms=20.0)


def token(token_id: int, timings: common_pb2.RequestTimings | None = None,
          last: bool = False) -> decode_pb2.DecodeResponse:
    message = decode_pb2.DecodeResponse(token_ids=[token_id])
    if timings is not None:
        message.timings.CopyFrom(timings)
    if last:
        message.finish_reason = common_pb2.FINISH_REASON_LENGTH
    return message


def relay_at(stream: StreamTimings, clock: FakeClock, at: float, message: decode_pb2.DecodeResponse):
    clock.now = at
    stream.relayed(message)
    return message


def test_one_decode_keeps_its_own_phases():
    clock = FakeClock(0.0)
    stream = StreamTimings(clock)
    stream.opening()
    relay_at(stream, clock, 0.2, token(1, FIRST))
    last = relay_at(stream, clock, 0.3, token(2, FIRST, last=True))
    assert last.timings == FIRST and last.timings.num_migrations == 0


def test_a_stream_lost_after_its_first_tokens_keeps_their_phases_and_shows_the_stall():
    clock = FakeClock(0.0)
    stream = StreamTimings(clock)
    stream.opening()
    relay_at(stream, clock, 1.0, token(1, FIRST))
    relay_at(stream, clock, 1.2, token(2))
    clock.now = 5.2  # silent past the inactivity deadline: lost
    stream.lost()
    stream.opening()
    resumed = relay_at(stream, clock, 5.9, token(3, RESUMED))
    assert not resumed.HasField("timings")  # the new decode's own phases are no TTFT
    last = relay_at(stream, clock, 6.0, token(4, RESUMED, last=True))
    timings = last.timings
    assert (timings.queue_ms, timings.prefill_ms, timings.transfer_ms, timings.first_decode_ms) == (5, 100, 2, 3)
    assert timings.num_migrations == 1
    assert abs(timings.migration_ms - 4700.0) < 1e-6  # last token before the loss to the next one
    assert timings.resume_prefill_ms == 400.0 and timings.resume_prefill_ms <= timings.migration_ms
    assert stream.last_token_at == 6.0


def test_two_moves_count_one_stall_each_and_a_decode_lost_before_its_first_token():
    """The second decode is lost before it sent a token: the stall runs on from the last token
    the client got, and only the third decode's recompute is prefill work."""
    clock = FakeClock(0.0)
    stream = StreamTimings(clock)
    stream.opening()
    relay_at(stream, clock, 1.0, token(1, FIRST))
    clock.now = 3.0
    stream.lost()
    stream.opening()
    clock.now = 6.0
    stream.lost()
    stream.opening()
    relay_at(stream, clock, 7.0, token(2, RESUMED))
    relay_at(stream, clock, 7.5, token(3))
    clock.now = 9.5
    stream.lost()
    stream.opening()
    last = relay_at(stream, clock, 10.0, token(4, RESUMED, last=True))
    timings = last.timings
    assert timings.num_migrations == 3 and timings.prefill_ms == 100.0
    assert abs(timings.migration_ms - (6000.0 + 2500.0)) < 1e-6
    assert timings.resume_prefill_ms == 800.0


def test_a_stream_lost_before_any_token_reports_the_next_decodes_phases_after_the_lost_time():
    """Nothing was sent: the next decode's first token is the request's, its phases are the
    TTFT's, and the time the lost decode held the request is `migration_ms` before them."""
    clock = FakeClock(0.0)
    stream = StreamTimings(clock)
    stream.opening()
    clock.now = 2.0
    stream.lost()
    clock.now = 2.5
    stream.opening()
    last = relay_at(stream, clock, 3.0, token(1, RESUMED, last=True))
    timings = last.timings
    assert (timings.queue_ms, timings.prefill_ms, timings.first_decode_ms) == (10.0, 400.0, 20.0)
    assert timings.num_migrations == 1 and timings.migration_ms == 2500.0 and timings.resume_prefill_ms == 0.0
