"""The prefill's sends by request id: the one state the engine thread's room (`EngineSends`)
and the service's (`ServiceSends`) share, behind one lock, with the verdicts posted for the
service to read.

A send is announced (its hand-off known), then started (its prompt computed), then done (a
verdict posted). The engine ends a request once; its blocks may go only when it has ended
and its send is done. Every transition below runs in one hold of the lock, so a request is
always found in exactly one of announced, sending or done, and its blocks are always
reported back.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Mapping

from pdserve.kvtransfer.connector.metadata import SendSpec
from pdserve.kvtransfer.stream import LayerStream
from pdserve.kvtransfer.verdict import TransferVerdict

log = logging.getLogger("pdserve.kvtransfer.connector")

MAX_REMEMBERED = 4096  # finished sends / verdicts kept for late readers


class VerdictBoard:
    """Verdicts of finished sends by request id, for the service to read (bounded)."""

    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self._cond = threading.Condition()
        self._verdicts: OrderedDict[str, TransferVerdict] = OrderedDict()
        self._capacity = capacity

    def post(self, request_id: str, verdict: TransferVerdict) -> None:
        with self._cond:
            self._verdicts[request_id] = verdict
            while len(self._verdicts) > self._capacity:
                self._verdicts.popitem(last=False)
            self._cond.notify_all()

    def wait(self, request_id: str, timeout_s: float) -> TransferVerdict | None:
        """The verdict (removed from the board), or None if none came within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while request_id not in self._verdicts:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._verdicts.pop(request_id)


class SendBook:
    def __init__(self) -> None:
        self.verdicts = VerdictBoard()
        self._lock = threading.Lock()
        self._sends: dict[str, SendSpec] = {}  # announced, not started
        self._streams: dict[str, LayerStream] = {}  # announced sends going out layer-wise
        self._sending: set[str] = set()  # started, not finished
        self._ended: set[str] = set()  # the engine said these finished
        self._sent: OrderedDict[str, None] = OrderedDict()  # done, not yet reported

    def announce(self, spec: SendSpec) -> bool:
        """Record an announced send; False if that request's send already started or ended."""
        with self._lock:
            if spec.request_id in self._sending or spec.request_id in self._sent:
                return False
            self._sends[spec.request_id] = spec
            return True

    def add_stream(self, request_id: str, make: Callable[[], LayerStream]) -> None:
        """`make()`'s stream carries the announced send of `request_id` (made under the lock,
        so a racing abort finds it); nothing if it has none or is gone."""
        with self._lock:
            if request_id not in self._streams and request_id in self._sends:
                self._streams[request_id] = make()

    def streams_of(self, request_ids: Mapping[str, int]) -> list[LayerStream]:
        with self._lock:
            return [stream for rid, stream in self._streams.items() if rid in request_ids]

    def take_ready(self, num_computed: Mapping[str, int]) -> list[tuple[SendSpec, LayerStream | None]]:
        """The announced sends whose prompts are computed, now started, with their streams.
        Popped in one hold of the lock, so a racing `drop` sees them gone."""
        with self._lock:
            ready = [self._sends.pop(rid) for rid, spec in list(self._sends.items())
                     if num_computed.get(rid, 0) >= spec.num_prompt_tokens]
            self._sending.update(spec.request_id for spec in ready)
            return [(spec, self._streams.pop(spec.request_id, None)) for spec in ready]

    def end(self, request_id: str) -> SendSpec | None:
        """The engine ended the request: its stream stops; the spec of a send that never
        started (the caller ends it, aborted). A send of ours is reported once done."""
        with self._lock:
            spec = self._sends.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.cancel()
            if spec is not None or request_id in self._sending or request_id in self._sent:
                self._ended.add(request_id)
        return spec

    def drop(self, request_id: str) -> SendSpec | None:
        """The request is being aborted: a send not started is done now (its spec returned,
        the caller posts its verdict); a stream stops sending layers."""
        with self._lock:
            spec = self._sends.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.cancel()  # no more layers go out; the receiver's reservation ends
            if spec is not None:
                self._mark_sent(request_id)
        return spec

    def finish(self, request_id: str, verdict: TransferVerdict) -> None:
        """The send of `request_id` is done with `verdict`."""
        with self._lock:
            self._mark_sent(request_id)
        self.post(request_id, verdict)

    def post(self, request_id: str, verdict: TransferVerdict) -> None:
        """`verdict` for the service to read (the send is already marked done), and logged."""
        (log.info if verdict.ok else log.warning)("request %s: %s", request_id, verdict.describe())
        self.verdicts.post(request_id, verdict)

    def _mark_sent(self, request_id: str) -> None:
        """(Lock held.) In the same hold as the pop that ended the send: `end` must find the
        request announced, sending or sent, or its blocks would never be reported back."""
        self._sending.discard(request_id)
        self._sent[request_id] = None
        while len(self._sent) > MAX_REMEMBERED:
            self._sent.popitem(last=False)

    def take_done(self) -> set[str]:
        """Requests the engine ended whose sends are done: their blocks may go."""
        with self._lock:
            done = {rid for rid in self._sent if rid in self._ended}
            for rid in done:
                del self._sent[rid]
                self._ended.discard(rid)
        return done
