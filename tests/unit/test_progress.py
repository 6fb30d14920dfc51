"""A long step's progress lines: one at the start, one per interval with what it is doing,
one at the end with its time; none after a failure says "done"."""
from __future__ import annotations

import logging
import threading

import pytest

from pdserve.common import progress


def test_a_long_step_ticks_with_what_it_is_doing_then_says_done(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.progress")
    ticked = threading.Event()
    part = ["reading"]

    class Ticks(logging.Handler):
        def emit(self, record):
            if "so far" in record.getMessage():
                ticked.set()

    handler = Ticks()
    logging.getLogger("pdserve.progress").addHandler(handler)
    try:
        with progress.step("converting m", every_s=0.05, doing=lambda: part[0]):
            assert ticked.wait(10)
            part[0] = "writing"
    finally:
        logging.getLogger("pdserve.progress").removeHandler(handler)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "converting m ..."
    assert any("so far, reading" in m for m in messages[1:-1])
    assert messages[-1].startswith("converting m: done in ")


def test_a_failing_step_stops_ticking_and_says_no_done(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.progress")
    with pytest.raises(RuntimeError):
        with progress.step("compiling k", every_s=0.05):
            raise RuntimeError("no compiler")
    assert not any("done" in r.getMessage() for r in caplog.records)
