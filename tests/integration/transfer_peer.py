"""The receiving process of the transfer conformance suite (run as a script, not collected).

Holds its own cache (zeros) and a CacheSink, opens the backend under test as a receiver
(transports) or a reader (stores), and obeys JSON-line commands on stdin. Replies are JSON
lines on stdout through `pdserve.lab.child` (anything else printed there is ignored).
Nothing is pickled across the process boundary.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pdserve.lab.child import serve_commands

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `kvcaches`


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from pdserve.kvtransfer import backend_loader
    from pdserve.kvtransfer.config import STORES, KVTransferConfig
    from pdserve.kvtransfer.receive import land_from_store
    from pdserve.kvtransfer.sink import CacheSink
    from kvcaches import block_digests, make_caches, tiny_layout

    state: dict = {}

    def handle(msg: dict) -> dict:
        cmd = msg["cmd"]
        if cmd == "init":
            layout = tiny_layout(**msg["layout"])
            config = KVTransferConfig(**msg["config"])
            caches = make_caches(layout)
            sink = CacheSink(caches, layout)
            state.update(layout=layout, caches=caches, sink=sink, name=msg["backend"])
            if msg["backend"] in STORES:
                state["store"] = backend_loader.open_store(msg["backend"], config)
                return {"endpoint": ""}
            if msg["backend"] == "tcp":  # the socket channel, not a registered transport
                from pdserve.kvtransfer.backends import tcp

                state["transport"] = tcp.create_transport(config)
            else:
                state["transport"] = backend_loader.open_transport(msg["backend"], config)
            return {"endpoint": state["transport"].open_receiver(sink)}
        sink = state["sink"]
        if cmd == "expect":
            sink.expect(bytes.fromhex(msg["transfer_id"]), msg["blocks"],
                        time.monotonic() + msg["within_s"], tag=msg.get("tag", ""), block_keys=msg.get("keys"))
            return {}
        if cmd == "fetch":
            n = land_from_store(state["store"], sink, bytes.fromhex(msg["transfer_id"]),
                                msg["blocks"], msg["keys"])
            return {"bytes": n}
        if cmd == "digests":
            return {"digests": block_digests(state["caches"], msg["blocks"])}
        if cmd == "abort":
            return {"aborted": sink.abort(bytes.fromhex(msg["transfer_id"]))}
        if cmd == "state":
            sink.expire_overdue()
            events = [{"transfer_id": e.transfer_id.hex(), "ok": e.ok, "reason": e.reason}
                      for e in sink.take_events()]
            return {"pending": sorted(t.hex() for t in sink.pending_transfer_ids),
                    "reserved": sorted(sink.reserved_block_ids), "refused": sink.num_refused,
                    "events": events}
        if cmd == "close":
            for _ in range(2):  # idempotent
                backend = state.get("transport") or state.get("store")
                backend.close()
                sink.close()
            return {}
        raise ValueError(f"unknown command {cmd!r}")

    serve_commands(handle)

if __name__ == "__main__":
    main()
