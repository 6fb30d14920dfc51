"""`pdserve up --planner` under a low -> high -> low ramp, as a user runs it: the planner grows
the decode workers while the load is high and shrinks them (draining) after it, and not one
request fails. On this machine more workers add no compute (2 cores): the point is that the
decisions follow the load and that a removal loses nothing. The timeline is printed (-s)."""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import MODEL, UpProcess

from pdserve.planner.observe import parse

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

FLAGS = ("--num-threads", "1", "--planner", "--slo-ttft-ms", "4000", "--slo-tpot-ms", "400",
         "--planner-interval-s", "2", "--planner-agree-intervals", "2", "--planner-cooldown-up-s", "4",
         "--planner-cooldown-down-s", "6", "--planner-max-decode", "2", "--planner-max-prefill", "2",
         "--planner-streams-per-decode", "0.6", "--drain-timeout-s", "8", "--worker-timeout-s", "5")
# The fallback wants rate x request time / streams-per-decode decodes: at 0.6, the high phase
# asks for two whether a request takes 0.4 s (a quiet machine) or 1.5 s (a loaded one), the low
# one for one.
# (requests/s, seconds at least): the high phase goes on until the grown decode is ready, the
# last until the planner has drained it, so their minimums only need to outlast a decision
RAMP = ((0.2, 6.0), (2.0, 30.0), (0.2, 10.0))
PHASE_DEADLINE_S = 180.0  # how much longer a phase may wait for the planner's change to show


class Load:
    """Open-loop chats at a rate that changes by phase; counts outcomes."""

    def __init__(self, url: str) -> None:
        self.url = url + "/chat/completions"
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.rate = 0.0
        self.stop = threading.Event()
        self._pool = ThreadPoolExecutor(48)

    def _one(self, i: int) -> None:
        body = {"model": MODEL, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": f"Name {i % 7 + 2} colours of the rainbow."}]}
        try:
            resp = httpx.post(self.url, json=body, timeout=180)
            good, why = resp.status_code == 200, f"{resp.status_code} {resp.text[:200]}"
        except httpx.HTTPError as exc:
            good, why = False, repr(exc)
        with self._lock:
            if good:
                self.ok += 1
            else:
                self.failed += 1
                self.errors.append(why)

    def run(self) -> None:
        i, next_at = 0, time.monotonic()
        while not self.stop.is_set():
            if self.rate > 0 and time.monotonic() >= next_at:
                self._pool.submit(self._one, i)
                i += 1
                next_at += 1 / self.rate
            self.stop.wait(0.02)

    def close(self) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True)


def _workers(base: str) -> dict[str, int]:
    sample = parse(httpx.get(base + "/metrics", timeout=10).text, time.monotonic())
    return dict(sample.num_alive)


def test_a_ramp_grows_and_shrinks_decode_with_no_failed_request():
    up = UpProcess(*FLAGS)
    load = None
    try:
        up.wait_for("planner on:")
        base = up.base_url.removesuffix("/v1")
        load = Load(up.base_url)
        threading.Thread(target=load.run, daemon=True).start()
        started, timeline = time.monotonic(), []

        def record() -> dict[str, int]:
            counts = _workers(base)
            entry = (round(time.monotonic() - started), load.rate, counts["prefill"], counts["decode"])
            if not timeline or timeline[-1][1:] != entry[1:]:
                timeline.append(entry)
            return counts

        # Each phase lasts its time at least, and the high one until the grown decode is ready
        # (a loaded machine loads a model slowly), the last until the planner has shrunk it.
        for (rate, seconds), until in zip(RAMP, (None, lambda c: c["decode"] >= 2, lambda c: c["decode"] <= 1)):
            load.rate, phase_end = rate, time.monotonic() + seconds
            deadline = phase_end + PHASE_DEADLINE_S
            while time.monotonic() < phase_end or (until is not None and not until(record())):
                record()
                assert time.monotonic() < deadline, timeline
                time.sleep(1)
        grown = max(d for *_, d in timeline)
        load.close()
        print("\nramp timeline (s, req/s, prefill, decode):", timeline)
        print(f"requests ok {load.ok}, failed {load.failed}")
        assert grown == 2, timeline
        assert load.failed == 0, load.errors[:5]
        assert load.ok > 40
        output = up.stop()
        print("".join(line for line in up.lines if "planner:" in line or "draining" in line or "is ready" in line
                      or "drained and exited" in line or "starting (pid" in line))
        assert "drained and exited" in output and "Traceback" not in output, output[-3000:]
    finally:
        if load is not None:
            load.close()
        up.stop()
