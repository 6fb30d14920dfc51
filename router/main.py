"""`pdserve router`: run the router until SIGINT/SIGTERM.

Imports no torch (a test asserts it): the router tokenizes with `tokenizers` and renders
chat templates with jinja2.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any, Mapping

from pdserve.router.config import ConfigError, RouterConfig

log = logging.getLogger("pdserve.router")


def main(settings: Mapping[str, Any]) -> int:
    try:
        config = RouterConfig.from_settings(settings)
    except ConfigError as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 1
    return 0


async def serve(config: RouterConfig) -> None:
    from pdserve.router.app import RouterApp

    app = RouterApp(config)
    await app.start()
    # One line a launcher (`pdserve up`) can wait for.
    print(f"pdserve router ready http://{config.host}:{app.http_port} grpc {config.host}:{app.grpc_port}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("router stopping")
        await app.stop()
