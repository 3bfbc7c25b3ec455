"""The frontend process: tokenizer + engine client + ASGI app, served by uvicorn on uvloop.

Shutdown on SIGINT/SIGTERM:
    1. uvicorn stops accepting connections and closes idle keep-alive ones;
    2. in-flight requests keep streaming for up to `config.shutdown_grace_s`;
    3. then every request still running gets an error (an SSE error event + [DONE], or
       a 500) and its engine request is aborted, so the connections end;
    4. the app's lifespan closes the engine client; `run_frontend` returns.
A second SIGINT forces uvicorn out at once. The signal is not re-raised afterwards
(uvicorn's own handlers would), so a launcher running the frontend in its own process
gets control back to stop its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from kvflow.proto.addresses import ServiceAddresses
from kvflow.routing import RoutingConfig
from kvflow.services.frontend.app import build_app
from kvflow.services.frontend.config import FrontendConfig
from kvflow.services.frontend.engine_client import EngineClient, Watchdog

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_SHUTDOWN_MARGIN_S = 5.0  # after failing streams, how long uvicorn waits for them to flush


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals are handled by run_frontend (see the module docstring).
        yield


def run_frontend(
    config: FrontendConfig,
    addresses: ServiceAddresses | Sequence[ServiceAddresses],
    model_dir: Path,
    watchdog: Watchdog | None = None,
    *,
    on_ready: Callable[[], None] | None = None,
    tokenizer: Any = None,
    routing: RoutingConfig | None = None,
    engine_watchdogs: Sequence[Watchdog] | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM; `on_ready` is called once the port accepts requests.
    `tokenizer`: the model's, if the caller loaded it already (else loaded here).
    Several `addresses`: one engine core each (data parallelism), routed by `routing`.
    `reuse_port`: several frontend processes listen on the same port (SO_REUSEPORT)."""
    if tokenizer is None:
        from kvflow.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir, config.skip_tokenizer_init)
    client = EngineClient(
        addresses,
        config.frontend_id,
        stats_timeout_s=config.stats_timeout_s,
        resend_wait_s=config.resend_wait_s,
        watchdog=watchdog,
        engine_watchdogs=engine_watchdogs,
        routing=routing,
    )
    app = build_app(config, client, tokenizer)
    web_ui = app.state.web_ui
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        log_level="warning",
        timeout_graceful_shutdown=int(config.shutdown_grace_s + _SHUTDOWN_MARGIN_S),
        **(config.tls.uvicorn_options() if config.tls is not None else {}),
    )
    server = _Server(uv_config)
    _run(
        serve(
            server,
            client,
            config.shutdown_grace_s,
            on_ready,
            on_exit=web_ui.close,
            shared_port=reuse_port,
        )
    )


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other processes may bind too: the kernel spreads new
    connections over them (how several API servers share one port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # no uvloop on this platform: the stdlib loop still works
        asyncio.run(main)
        return
    uvloop.run(main)


async def serve(
    server: uvicorn.Server,
    client: EngineClient,
    grace_s: float,
    on_ready: Callable[[], None] | None = None,
    on_exit: Callable[[], None] | None = None,
    shared_port: bool = False,
) -> None:
    """Run `server` until it is told to exit; fail the streams still open `grace_s`
    after that (steps 2-3 of the module docstring). `on_exit` is called as soon as
    the server is told to exit (the web UI ends its never-ending stats streams).
    The port opens once every engine serves, or after the client's stats timeout
    (then /health says why not): a request before the first stats would get a 503
    from a server that already said it was up. `shared_port`: bind with SO_REUSEPORT."""
    _install_signal_handlers(server)
    if not client.started:
        await client.start()
    await _wait_for_engines(server, client)
    if server.should_exit:  # told to stop while waiting: the lifespan never runs
        await client.close()
        return
    sockets = None
    if shared_port:
        sockets = [shared_port_socket(server.config.host, server.config.port)]
    serving = asyncio.create_task(server.serve(sockets=sockets))
    watcher = asyncio.create_task(_watch(server, client, grace_s, on_ready, on_exit))
    try:
        await serving
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _wait_for_engines(server: uvicorn.Server, client: EngineClient) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + client.stats_timeout_s
    while not client.every_engine_serves and not server.should_exit:
        if loop.time() >= deadline:
            logger.warning(
                "opening the port before every engine serves: %s", client.engine_problems()
            )
            return
        await asyncio.sleep(_POLL_S)


async def _watch(
    server: uvicorn.Server,
    client: EngineClient,
    grace_s: float,
    on_ready: Callable[[], None] | None,
    on_exit: Callable[[], None] | None = None,
) -> None:
    while not server.started and not server.should_exit:
        await asyncio.sleep(_POLL_S)
    if server.started and on_ready is not None:
        on_ready()
    while not server.should_exit:
        await asyncio.sleep(_POLL_S)
    logger.info("shutting down: %d request(s) in flight", client.num_in_flight)
    if on_exit is not None:
        on_exit()
    deadline = asyncio.get_running_loop().time() + grace_s
    while client.num_in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(_POLL_S)
    client.fail_all("the server is shutting down", abort=True)


def _install_signal_handlers(server: uvicorn.Server) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may own signals (tests run servers in threads)
    loop = asyncio.get_running_loop()

    def handle(sig: signal.Signals) -> None:
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle, sig)
