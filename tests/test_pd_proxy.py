"""The read-mode P/D proxy against stand-in servers (aiohttp apps that
record what they were sent): the split of a request, streaming, round
robin, a failed prefill, and the pair's checks. No vLLM engine runs here:
the real pair is tests/test_pd_servers.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from aiohttp import ClientSession, web

from neuron_scheduler.offline.engine_spec import EngineSpec
from neuron_scheduler.offline.pd_proxy import (
    ProxyTargets,
    build_app,
    decode_body,
    prefill_body,
)
from neuron_scheduler.offline.pd_proxy import main as proxy_main
from neuron_scheduler.offline.pd_servers import (
    DisaggregatedServers,
    PairSpec,
    check_pair,
    kv_folder_parent,
    kv_transfer_config,
)


def _stand_in(
    name: str, seen: list, headers: list, prefill_status: int = 200
) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((name, body))
        headers.append((name, request.headers.get("X-Request-Id")))
        if body.get("max_tokens") == 1 and not body.get("stream"):
            if prefill_status != 200:
                return web.json_response({"error": "boom"}, status=prefill_status)
            return web.json_response(
                {"choices": [{"text": "x"}], "kv_transfer_params": {"from": name}}
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in ("a", "b", "c"):
            await response.write(f"data: {json.dumps({'t': token})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _through_proxy(
    bodies: list[dict], prefill_status: int = 200, request_ids: list | None = None
):
    seen: list = []
    headers: list = []
    runners, urls = [], {}
    for name in ("p0", "p1", "d0", "d1"):
        status = prefill_status if name.startswith("p") else 200
        runner, url = await _serve(_stand_in(name, seen, headers, status))
        runners.append(runner)
        urls[name] = url
    targets = ProxyTargets((urls["p0"], urls["p1"]), (urls["d0"], urls["d1"]))
    proxy, proxy_url = await _serve(build_app(targets))
    answers = []
    try:
        async with ClientSession() as session:
            async with session.get(f"{proxy_url}/health") as answer:
                health = answer.status
            for body, request_id in zip(
                bodies, request_ids or [None] * len(bodies), strict=True
            ):
                given = {"X-Request-Id": request_id} if request_id else {}
                async with session.post(
                    f"{proxy_url}/v1/completions", json=body, headers=given
                ) as answer:
                    answers.append((answer.status, await answer.read()))
    finally:
        for runner in (proxy, *runners):
            await runner.cleanup()
    if request_ids is not None:
        return health, answers, seen, headers
    return health, answers, seen


def test_a_request_is_prefilled_for_one_token_then_decoded_and_streamed():
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    health, answers, seen = asyncio.run(_through_proxy([body, body, body]))
    assert health == 200
    assert [status for status, _ in answers] == [200, 200, 200]
    assert answers[0][1].count(b"data: ") == 4 and answers[0][1].endswith(b"[DONE]\n\n")
    # Prefill then decode for each request; each pool taken in turn.
    assert [name for name, _ in seen] == ["p0", "d0", "p1", "d1", "p0", "d0"]
    prefill, decode = seen[0][1], seen[1][1]
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert prefill["prompt"] == body["prompt"]
    assert decode == {**body, "kv_transfer_params": {"from": "p0"}}


def test_both_servers_name_a_request_alike():
    body = {"model": "m", "prompt": [5], "max_tokens": 4, "stream": True}
    *_, headers = asyncio.run(
        _through_proxy([body] * 3, request_ids=["mine", None, None])
    )
    ids = [request_id for _, request_id in headers]
    # Prefill and decode of each request share its id: the user's, else a new one.
    assert ids[0] == ids[1] == "mine"
    assert ids[2] == ids[3] and ids[4] == ids[5]
    assert len({ids[0], ids[2], ids[4]}) == 3 and None not in ids


def test_a_failed_prefill_answers_its_error_and_sends_no_decode():
    body = {"model": "m", "prompt": [5], "max_tokens": 4, "stream": True}
    _, answers, seen = asyncio.run(_through_proxy([body], prefill_status=503))
    assert answers[0][0] == 503 and b"boom" in answers[0][1]
    assert [name for name, _ in seen] == ["p0"]


def test_bodies_keep_what_the_user_sent():
    user = {"prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50,
            "min_tokens": 10, "kv_transfer_params": {"k": 1}}  # fmt: skip
    prefill = prefill_body(user)
    assert prefill["max_tokens"] == 1 and prefill["min_tokens"] == 0
    assert "max_completion_tokens" not in prefill
    assert prefill["kv_transfer_params"] == {"k": 1, "do_remote_decode": True}
    assert user["max_tokens"] == 50  # not changed in place
    assert decode_body(user, {"choices": []}) == user


async def _client_ports(backend_keepalive_s: float, pause_s: float) -> list:
    """The client port each request reached the prefill server from: two
    requests back to back, then one after ``pause_s`` idle."""
    ports: list = []

    async def complete(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    backend, url = await _serve(app)
    proxy, proxy_url = await _serve(
        build_app(ProxyTargets((url,), (url,)), backend_keepalive_s)
    )
    body = {"model": "m", "prompt": [5], "max_tokens": 4}
    try:
        async with ClientSession() as session:
            for pause in (0.0, 0.0, pause_s):
                await asyncio.sleep(pause)
                async with session.post(f"{proxy_url}/v1/completions", json=body) as a:
                    assert a.status == 200
    finally:
        await proxy.cleanup()
        await backend.cleanup()
    return ports[::2]  # each request's prefill (its decode went to the same)


def test_the_proxy_drops_a_connection_idle_past_its_keepalive():
    # A connection idle longer than the proxy's keep-alive is not reused (a
    # vLLM server closes its own after 5 s; one sent on as it closes fails).
    ports = asyncio.run(_client_ports(backend_keepalive_s=0.3, pause_s=0.8))
    assert ports[0] == ports[1] != ports[2]
    # Held longer, the same idle connection is reused.
    ports = asyncio.run(_client_ports(backend_keepalive_s=30, pause_s=0.8))
    assert ports[0] == ports[1] == ports[2]


@pytest.mark.parametrize("keepalive", [0, -1.0, float("nan")])
def test_the_proxys_keepalive_is_checked(keepalive):
    targets = ProxyTargets(("http://a:1",), ("http://b:2",))
    with pytest.raises(ValueError, match=f"backend keep-alive {keepalive!r}"):
        build_app(targets, keepalive)
    with pytest.raises(SystemExit):
        proxy_main(["--prefill", "http://a:1", "--decode", "http://b:2",
                    "--port", "1", "--backend-keepalive", str(keepalive)])  # fmt: skip


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        ((), ("http://a:1",), "at least one prefill"),
        (("http://a:1",), ("a:2",), "'a:2'"),
    ],
)
def test_proxy_targets_are_checked(prefill, decode, message):
    with pytest.raises(ValueError, match=message):
        ProxyTargets(prefill, decode)


def test_a_pair_must_agree_on_what_a_transfer_carries(tmp_path):
    spec = EngineSpec(
        model="m", max_model_len=512, max_num_batched_tokens=512, block_size=32
    )
    check_pair(PairSpec(spec, spec))
    with pytest.raises(ValueError, match="block_size 64 differs .* 32"):
        check_pair(PairSpec(spec, replace(spec, block_size=64)))
    with pytest.raises(ValueError, match="max_model_len 1024 differs"):
        check_pair(PairSpec(spec, replace(spec, max_model_len=1024)))
    with pytest.raises(ValueError, match="max_num_batched_tokens 256 is below .* 512"):
        check_pair(PairSpec(replace(spec, max_num_batched_tokens=256), spec))
    with pytest.raises(ValueError, match="a decode pool of 0"):
        check_pair(PairSpec(spec, spec, decode_engines=0))
    config = json.loads(kv_transfer_config(tmp_path))
    assert config["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    assert config["kv_connector"] == "AlignedExampleConnector"


def test_the_kv_folder_goes_in_memory_where_it_has_room(tmp_path):
    assert kv_folder_parent(tmp_path, min_free_bytes=1) == tmp_path
    assert kv_folder_parent(tmp_path, min_free_bytes=1 << 60) is None
    assert kv_folder_parent(tmp_path / "absent") is None
    spec = EngineSpec(
        model="m", max_model_len=512, max_num_batched_tokens=512, block_size=32
    )
    pair = DisaggregatedServers(PairSpec(spec, spec), tmp_path / "logs")
    # The pair's own folder: in kv_folder_parent(), gone once stopped.
    parent = kv_folder_parent()
    if parent is not None:
        assert pair.storage.parent == parent
    assert pair.storage.is_dir()
    (pair.storage / "kv").mkdir()
    pair.stop()
    assert not pair.storage.exists()
    given = DisaggregatedServers(PairSpec(spec, spec), tmp_path, storage=tmp_path)
    given.stop()
    assert tmp_path.is_dir()


def test_the_connector_looks_up_the_tokens_it_stores():
    from neuron_scheduler.offline.pd_connector import stored_prompt_tokens

    assert [stored_prompt_tokens(n, 32) for n in (1, 2, 32, 33, 64, 65, 97)] == [
        0, 0, 0, 32, 32, 64, 96,
    ]  # fmt: skip
