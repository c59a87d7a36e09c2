"""A read-mode proxy for disaggregated prefill/decode (xPyD) over vLLM
OpenAI servers, as AWS documents for Neuron and vLLM's own toy proxy does.

For each ``/v1/completions`` or ``/v1/chat/completions`` request it

1. sends the request to a prefill server with ``max_tokens=1`` (not
   streamed; ``kv_transfer_params: {"do_remote_decode": true}`` for
   connectors that hold the prompt's KV until it is pulled, NIXL's name);
   that token is not the user's;
2. sends the original request to a decode server, with the
   ``kv_transfer_params`` the prefill answered (where the connector gave
   any), and streams the decode server's answer back as it comes: the decode
   engine loads the prompt's KV through its connector and produces every
   token the user sees.

Both requests carry one ``X-Request-Id`` (the user's, else a new one), so
the two servers' logs name a request alike, as vLLM's own proxy does.
Servers of each pool are taken in turn (round robin). A connection to a
server idle longer than ``--backend-keepalive`` seconds (default 2, below
the 5 s a vLLM server keeps one) is not reused: one the server is closing
as a request is sent on it fails that request. A prefill that fails
ends the request with the prefill server's status and body; nothing is sent
to a decode server then. ``/health`` answers 200 only when every server
does. Run it as ``python -m neuron_scheduler.offline.pd_proxy --prefill URL
--decode URL --port PORT`` (127.0.0.1 unless ``--host``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Paths the proxy splits into a prefill and a decode request.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")

#: The header a vLLM server takes its request id from.
REQUEST_ID_HEADER = "X-Request-Id"

#: Seconds the proxy reuses an idle connection to a server: below vLLM's
#: default keep-alive (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s), so the proxy
#: drops a connection before the server closes it.
BACKEND_KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class ProxyTargets:
    """The servers behind the proxy: base URLs of each pool."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    def __post_init__(self) -> None:
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            if not urls:
                raise ValueError(f"the proxy needs at least one {role} server")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(
                        f"{role} server {url!r}: expected http://HOST:PORT"
                    )


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request for the user's ``body``: one token, not
    streamed, and asking the connector to keep the KV for the decode side."""
    request = {k: v for k, v in body.items() if k != "stream_options"}
    request.update(stream=False, max_tokens=1, min_tokens=0)
    request.pop("max_completion_tokens", None)
    request["kv_transfer_params"] = {
        **(body.get("kv_transfer_params") or {}),
        "do_remote_decode": True,
    }
    return request


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode server's request: the user's ``body``, with the
    ``kv_transfer_params`` the prefill server answered, if any."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


def build_app(
    targets: ProxyTargets, backend_keepalive_s: float = BACKEND_KEEPALIVE_S
) -> Any:
    """The proxy as an ``aiohttp`` application; it reuses a connection to a
    server idle at most ``backend_keepalive_s`` seconds (> 0)."""
    if not backend_keepalive_s > 0:
        raise ValueError(
            f"backend keep-alive {backend_keepalive_s!r}: expected seconds > 0"
        )
    import aiohttp
    from aiohttp import web

    prefill_turns: Iterator[str] = itertools.cycle(targets.prefill)
    decode_turns: Iterator[str] = itertools.cycle(targets.decode)
    sessions: list[aiohttp.ClientSession] = []

    async def on_startup(app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        connector = aiohttp.TCPConnector(keepalive_timeout=backend_keepalive_s)
        sessions.append(aiohttp.ClientSession(timeout=timeout, connector=connector))

    async def on_cleanup(app: web.Application) -> None:
        for session in sessions:
            await session.close()

    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as error:
            return web.json_response({"error": f"not JSON: {error}"}, status=400)
        session = sessions[0]
        headers = forwarded_headers(request.headers)
        prefill_url = next(prefill_turns) + request.path
        async with session.post(
            prefill_url, json=prefill_body(body), headers=headers
        ) as answer:
            payload = await answer.read()
            if answer.status != 200:
                return web.Response(
                    status=answer.status,
                    body=payload,
                    content_type=answer.content_type,
                )
        decoded = decode_body(body, json.loads(payload))
        decode_url = next(decode_turns) + request.path
        async with session.post(decode_url, json=decoded, headers=headers) as answer:
            response = web.StreamResponse(
                status=answer.status,
                headers={"Content-Type": answer.headers.get("Content-Type", "")},
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(request: web.Request) -> web.Response:
        session = sessions[0]
        for url in (*targets.prefill, *targets.decode):
            try:
                async with session.get(f"{url}/health") as answer:
                    if answer.status != 200:
                        return web.Response(status=503, text=f"{url}: {answer.status}")
            except aiohttp.ClientError as error:
                return web.Response(status=503, text=f"{url}: {error}")
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for path in GENERATION_PATHS:
        app.router.add_post(path, generate)
    app.router.add_get("/health", health)
    return app


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """What both servers are sent of the user's ``headers``: their
    ``Authorization`` and an ``X-Request-Id`` (theirs, else a new one)."""
    kept = {k: v for k, v in headers.items() if k.lower() == "authorization"}
    given = next(
        (v for k, v in headers.items() if k.lower() == REQUEST_ID_HEADER.lower()), None
    )
    kept[REQUEST_ID_HEADER] = given or uuid.uuid4().hex
    return kept


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m neuron_scheduler.offline.pd_proxy",
        description="read-mode proxy in front of prefill and decode vLLM servers",
    )
    parser.add_argument("--prefill", action="append", required=True, metavar="URL")
    parser.add_argument("--decode", action="append", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--backend-keepalive",
        type=float,
        default=BACKEND_KEEPALIVE_S,
        metavar="SECONDS",
        help="reuse a connection to a server idle at most this long; keep it "
        "below the servers' keep-alive (vLLM's: 5 s) (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        targets = ProxyTargets(tuple(args.prefill), tuple(args.decode))
        app = build_app(targets, args.backend_keepalive)
    except ValueError as error:
        parser.error(str(error))
    from aiohttp import web

    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
