"""The reaper: every open lab of this process closed at interpreter exit and on SIGTERM/SIGHUP,
so a lab never outlives the process that made it (a SIGKILLed one is swept by the next lab:
`namespaces.sweep_orphans`)."""
from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


class Reaper:
    """The open labs of this process, closed at exit and on SIGTERM/SIGHUP (then the signal
    goes on to whatever handled it before; the handlers are installed when the first lab
    opens on the main thread)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.labs: list[Closable] = []
        self.previous: dict[int, object] = {}
        self.installed = False

    def adopt(self, lab: Closable) -> None:
        self.labs.append(lab)
        if not self.installed:
            self.installed = True
            atexit.register(self.close_all)
            if threading.current_thread() is threading.main_thread():
                for sig in self.SIGNALS:
                    self.previous[sig] = signal.signal(sig, self.on_signal)

    def release(self, lab: Closable) -> None:
        with contextlib.suppress(ValueError):
            self.labs.remove(lab)

    def close_all(self) -> None:
        for lab in list(reversed(self.labs)):
            lab.close()

    def on_signal(self, sig: int, frame) -> None:
        self.close_all()
        previous = self.previous.get(sig, signal.SIG_DFL)
        if callable(previous):
            previous(sig, frame)
        elif previous != signal.SIG_IGN:  # the default ends the process: as an exit, finally blocks run
            raise SystemExit(128 + sig)


REAPER = Reaper()
