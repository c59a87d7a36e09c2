"""Does a request fail when sent on a connection the server is closing?

vLLM's OpenAI server (uvicorn) closes a connection idle for
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds (default 5); vLLM's benchmark client
(aiohttp) keeps idle connections 60 s and reuses the oldest first. This
starts a uvicorn server in a thread (one POST route answering at once) and
an aiohttp client, and sends ``--requests`` pairs: a request, an idle gap
around ``--around`` seconds (spread over ±20 ms), a second request on the
idle connection. It prints how many second requests failed, with their
gaps and errors. No vLLM runs; the two libraries are vLLM's own.

Usage: .venv/bin/python scripts/keep-alive-race.py [--server 5] [--client 60]
       [--around SERVER] [--requests 41]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

from neuron_scheduler.offline.server import free_port


def _app() -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict[str, bool]:
        return {"ok": True}

    return app


def serve(server_keep_alive_s: float) -> int:
    """A uvicorn server on 127.0.0.1 in a daemon thread; its port."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        _app(),
        host="127.0.0.1",
        port=port,
        timeout_keep_alive=server_keep_alive_s,  # type: ignore[arg-type]
        log_level="warning",
    )
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the uvicorn server did not start in 10 s")
        time.sleep(0.05)
    return port


async def second_requests(
    port: int, client_keepalive_s: float, gaps: list[float]
) -> list[tuple[float, str]]:
    """Each gap's second request that failed: (gap, error)."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    connector = aiohttp.TCPConnector(keepalive_timeout=client_keepalive_s)
    failed = []
    async with aiohttp.ClientSession(connector=connector) as session:
        for gap in gaps:
            async with session.post(url, json={}) as answer:
                await answer.read()
            await asyncio.sleep(gap)
            try:
                async with session.post(url, json={}) as answer:
                    await answer.read()
            except aiohttp.ClientError as error:
                failed.append((gap, f"{type(error).__name__}: {error}"))
    return failed


def gaps_around(around_s: float, count: int) -> list[float]:
    """``count`` gaps spread evenly over ``around_s`` ± 20 ms."""
    if count < 2:
        return [around_s]
    return [around_s - 0.02 + 0.04 * i / (count - 1) for i in range(count)]


def main(argv: list[str] | None = None) -> list[tuple[float, str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--server", type=float, default=5.0, help="server keep-alive, s"
    )
    parser.add_argument(
        "--client", type=float, default=60.0, help="client keep-alive, s"
    )
    parser.add_argument(
        "--around", type=float, help="gap centre, s (default: --server)"
    )
    parser.add_argument("--requests", type=int, default=41)
    args = parser.parse_args(argv)
    for name in ("server", "client", "around"):
        value = getattr(args, name)
        if value is not None and not value > 0.02:
            parser.error(f"--{name} {value}: expected seconds > 0.02")
    if args.requests < 1:
        parser.error(f"--requests {args.requests}: expected 1 or more")
    gaps = gaps_around(args.around or args.server, args.requests)
    failed = asyncio.run(second_requests(serve(args.server), args.client, gaps))
    print(
        f"server keep-alive {args.server:g} s, client {args.client:g} s: "
        f"{len(failed)} of {len(gaps)} requests failed after an idle gap of "
        f"{gaps[0]:.3f}-{gaps[-1]:.3f} s"
    )
    for gap, error in failed:
        print(f"  gap {gap:.3f} s: {error}")
    return failed


if __name__ == "__main__":
    main()
