"""Long start-up steps say they are alive: a line when one starts, one every `EVERY_S`
while it runs (with what it is doing now), and one when it ends. Lines, not bars: `pdserve
up`, terminals and log collectors all read them one line at a time."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

log = logging.getLogger("pdserve.progress")

EVERY_S = 10.0


@contextlib.contextmanager
def step(what: str, every_s: float = EVERY_S, doing: Callable[[], str] | None = None) -> Iterator[None]:
    """Log `what` now, then every `every_s` seconds until the block ends (with `doing()`, the
    current part, when given), then how long it took. A failing block logs no "done"."""
    started = time.monotonic()
    finished = threading.Event()
    log.info("%s ...", what)

    def tick() -> None:
        while not finished.wait(every_s):
            now = f", {doing()}" if doing else ""
            log.info("%s: %.0f s so far%s", what, time.monotonic() - started, now)

    ticker = threading.Thread(target=tick, name="pdserve-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        finished.set()
        ticker.join(1.0)
    log.info("%s: done in %.1f s", what, time.monotonic() - started)
