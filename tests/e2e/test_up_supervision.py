"""`pdserve up` survives a crashed worker, as a user runs it: with 2 decodes, a SIGKILL of the
decode serving a stream lets the stream go on (the router migrates it) with transformers'
greedy text, and `up` restarts the decode; then a SIGKILL of the prefill: `up` restarts it
too, each is back and registered within 60 s, and chats succeed. Ctrl-C stops everything
without a traceback."""
from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest
from harness import MODEL, UpProcess, stream_and_disrupt

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

CHAT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
LONG = [{"role": "user", "content": "Summarise this log in one line. " + " ".join(
    f"At {i} o'clock the keeper checked the lamp and the tide." for i in range(12))}]
MAX_TOKENS = 40


def _registered(up: UpProcess, num_decode: int, num_prefill: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(up.base_url.replace("/v1", "/health"), timeout=5).json()
        if health.get("decode_workers") == num_decode and health.get("prefill_workers") == num_prefill:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.2)


def test_up_restarts_a_killed_decode_and_prefill_and_keeps_serving(hf_reference):
    _, greedy = hf_reference
    up = UpProcess("--num-decode", "2", "--num-threads", "1", "--worker-timeout-s", "3")
    try:
        up.wait_for("pdserve is up")
        client = up.openai()
        killed_at = 0.0

        def kill(worker: str) -> None:
            nonlocal killed_at
            os.kill(up.pid_of(worker), signal.SIGKILL)
            killed_at = time.monotonic()

        text, worker, _ = stream_and_disrupt(client, CHAT, MAX_TOKENS, kill)
        assert text == greedy(CHAT, MAX_TOKENS)  # migrated to the other decode, no gap, no repeat
        up.wait_for(f"{worker} exited with signal 9 (SIGKILL); restarting it", timeout_s=30)
        up.wait_for(f"{worker} is back", timeout_s=60)
        _registered(up, 2, 1, timeout_s=max(1.0, 60 - (time.monotonic() - killed_at)))
        print(f"\n{worker} killed mid-stream: back and registered after {time.monotonic() - killed_at:.1f} s")

        os.kill(up.pid_of("prefill-0"), signal.SIGKILL)
        killed_at = time.monotonic()
        after_kill = up.wait_for("prefill-0 exited with signal 9 (SIGKILL)", timeout_s=30)
        # while it is gone, decode serves (prefilling itself); once it is back, it prefills again
        chat = client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == greedy(LONG, 8)
        up.wait_for("prefill-0 is back", timeout_s=60, since=after_kill)
        _registered(up, 2, 1, timeout_s=max(1.0, 60 - (time.monotonic() - killed_at)))
        print(f"prefill-0 killed: back and registered after {time.monotonic() - killed_at:.1f} s")
        chat = client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == greedy(LONG, 8)
        assert up.proc.poll() is None
    finally:
        output = up.stop()
    assert up.proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "pdserve up: stopped" in output
