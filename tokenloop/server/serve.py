"""`tokenloop serve`: load the engine, start its step loop, serve the OpenAI-compatible app with uvicorn.

SIGTERM (or Ctrl-C) drains: the listening socket closes at once and new requests on open connections get a
503; running requests go on for up to `shutdown_timeout` seconds; then each one still running ends with a last
chunk (finish_reason "abort") and `[DONE]`, and the process exits with status 0.

If the engine's step loop dies, every open stream ends with an error event, `/health` answers 503 for FLUSH_S
seconds, and the process exits with status 1, for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import uvicorn

from tokenloop.engine.async_engine import AsyncEngine, AsyncEngineConfig
from tokenloop.engine.client import EngineClient
from tokenloop.engine.config import EngineConfig
from tokenloop.server.app import DEFAULT_MAX_N, build_app
from tokenloop.server.body_limit import DEFAULT_MAX_BODY_MB

if TYPE_CHECKING:
    from tokenloop.disaggregation.frontend import DisaggregationConfig

logger = logging.getLogger(__name__)
FLUSH_S = 2.0  # after the aborts, for the last chunks to reach their clients
SEND_BUFFER_BYTES = 64 * 1024


@dataclass(slots=True)
class ServerConfig:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_n: int = DEFAULT_MAX_N  # bound on n and best_of
    max_body_mb: float = DEFAULT_MAX_BODY_MB  # bound on a request's body; past it, a 413
    shutdown_timeout: float = 30.0  # seconds running requests may go on after SIGTERM
    limits: AsyncEngineConfig = field(default_factory=AsyncEngineConfig)
    disaggregation: DisaggregationConfig | None = None  # prefill and decode in worker processes (disaggregation/)

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if not self.max_body_mb > 0:
            raise ValueError(f"max_body_mb must be > 0, got {self.max_body_mb}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but a signal starts a drain (not a cut after the timeout) and is not re-raised at exit
    (uvicorn re-raises it, which makes the exit status 143)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: stop now
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.engine.draining = True
        loop = asyncio.get_running_loop()
        abort = loop.call_later(self.shutdown_timeout, self._abort_remaining)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    def engine_died(self, error: BaseException) -> None:
        """On the step thread: exit after FLUSH_S (the streams' error events sent, /health saying 503 meanwhile)."""
        threading.Timer(FLUSH_S, setattr, (self, "should_exit", True)).start()

    def _abort_remaining(self) -> None:
        if self.engine.num_in_flight:
            logger.warning("shutdown timeout: ending %d requests with finish_reason 'abort'", self.engine.num_in_flight)
            self.engine.abort_all()


def serve(engine_config: EngineConfig, config: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.disaggregation is not None:
        from tokenloop.disaggregation.frontend import DisaggregatedEngine

        engine = DisaggregatedEngine(engine_config, config.disaggregation, config.limits)
    else:
        engine = AsyncEngine(engine_config, config=config.limits)
    app = build_app(
        engine, config.model_name, config.api_key, config.max_n, config.max_body_mb, engine_config.lora_modules
    )
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        timeout_graceful_shutdown=config.shutdown_timeout + FLUSH_S,
    )
    sock = uv_config.bind_socket()
    # Accepted connections inherit this: a fixed kernel send buffer per connection (not autotuned up to 4 MiB),
    # so a slow reader's stream backs up into the server soon, where its request is paused (AsyncEngine).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    # And no Nagle: asyncio's accepted sockets here keep it on, so a response's second write (the body after the
    # headers, the next stream chunk) waited for the client's delayed ACK, tens of milliseconds on every request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server = _DrainingServer(uv_config, engine, config.shutdown_timeout)
    engine.on_death = server.engine_died
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if engine.death is not None:
        logger.critical("exiting with status 1: the engine's step loop died (%r)", engine.death)
        raise SystemExit(1)
