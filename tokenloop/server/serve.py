"""`tokenloop serve`: load the engine, start its step loop, serve the OpenAI-compatible app with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from tokenloop.engine.async_engine import AsyncEngine
from tokenloop.engine.llm_engine import EngineConfig, LLMEngine
from tokenloop.server.app import build_app


def serve(config: EngineConfig, model_name: str, host: str, port: int, api_key: str | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(LLMEngine(config))
    app = build_app(engine, model_name, api_key)
    try:
        # On SIGTERM uvicorn stops accepting, lets running requests finish (up to the timeout), then returns.
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
    finally:
        engine.shutdown()
