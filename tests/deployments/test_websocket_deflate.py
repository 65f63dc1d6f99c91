"""deployments/ingress/websocket_deflate.py: a uvicorn server configured after the call (as Serve configures an ingress
replica's own server after its __init__) accepts a client's WebSocket without permessage-deflate, on the real
uvicorn and websockets libraries, and binary audio frames still round-trip."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
import uvicorn.config
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect

from deployments.ingress.websocket_deflate import decline_permessage_deflate


async def _echo(websocket: WebSocket) -> None:
    await websocket.accept()
    data = await websocket.receive_bytes()
    await websocket.send_bytes(data[::-1])
    await websocket.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_setting_defaults_to_off_and_an_explicit_choice_stays(monkeypatch):
    monkeypatch.setattr(uvicorn.config.Config, "__init__", uvicorn.config.Config.__init__)  # restored afterwards
    assert uvicorn.Config(app=_echo).ws_per_message_deflate is True  # uvicorn's own default
    decline_permessage_deflate()
    decline_permessage_deflate()  # idempotent: one wrapper
    assert uvicorn.Config(app=_echo).ws_per_message_deflate is False
    assert uvicorn.Config(app=_echo, ws_per_message_deflate=True).ws_per_message_deflate is True


def test_a_client_offering_deflate_gets_a_socket_without_it(monkeypatch):
    monkeypatch.setattr(uvicorn.config.Config, "__init__", uvicorn.config.Config.__init__)
    app = Starlette(routes=[WebSocketRoute("/ws", _echo)])

    async def run(decline: bool) -> tuple[list, bytes]:
        if decline:
            decline_permessage_deflate()
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve())
        while not server.started:  # set by uvicorn once it listens; a server that could not start ends its task
            if serving.done():
                serving.result()
                raise RuntimeError("uvicorn stopped before it listened")
            await asyncio.sleep(0.01)
        try:
            # the client offers permessage-deflate, as browsers and the websockets library do by default
            async with connect(f"ws://127.0.0.1:{port}/ws", max_size=None) as ws:
                await ws.send(bytes(range(256)) * 400)
                answer = await ws.recv()
                return [type(e).__name__ for e in ws.protocol.extensions], answer
        finally:
            server.should_exit = True
            await serving

    offered, _ = asyncio.run(run(decline=False))
    assert offered == ["PerMessageDeflate"]  # without the call, uvicorn accepts the offer
    extensions, answer = asyncio.run(run(decline=True))
    assert extensions == [] and answer == (bytes(range(256)) * 400)[::-1]
