"""Assemble and run the server: LLM -> EngineService (engine thread) -> FastAPI app ->
uvicorn. SIGTERM / SIGINT: uvicorn stops accepting connections and lets open responses
finish (up to `graceful_s`); then the engine thread aborts whatever still runs and the
process exits 0."""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Optional

from jaxinfer.serving.api import build_app
from jaxinfer.serving.engine_thread import EngineService
from jaxinfer.serving.prom import ServerMetrics

log = logging.getLogger(__name__)


def make_app(llm, *, model_name: str, api_key: Optional[str] = None, max_queue: int = 1024,
             default_max_tokens: int = 512, deadline_s: Optional[float] = None):
  """-> (app, service). The service's thread starts with the app (lifespan) and stops
  with it."""
  metrics = ServerMetrics(model_name)
  service = EngineService(llm.engine, max_queue=max_queue, metrics=metrics)
  metrics.refresh(llm.engine)
  app = build_app(service, llm, model_name=model_name, api_key=api_key,
                  default_max_tokens=default_max_tokens, metrics=metrics,
                  default_deadline_s=deadline_s)

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    service.start()
    try:
      yield
    finally:
      service.shutdown()

  app.router.lifespan_context = lifespan
  return app, service


def serve(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: Optional[str] = None, max_queue: int = 1024, default_max_tokens: int = 512,
          deadline_s: Optional[float] = None, graceful_s: float = 10.0,
          log_level: str = "warning") -> None:
  import uvicorn
  app, _ = make_app(llm, model_name=model_name, api_key=api_key, max_queue=max_queue,
                    default_max_tokens=default_max_tokens, deadline_s=deadline_s)
  config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=graceful_s, access_log=False)
  server = uvicorn.Server(config)
  # uvicorn handles SIGTERM / SIGINT itself (graceful shutdown), then re-raises the signal
  # into the handlers that were installed before it: these make that a clean exit (0 for
  # SIGTERM, 130 for Ctrl-C) instead of death by signal.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
  print(f"[jaxinfer] serving {model_name} on http://{host}:{port}/v1", file=sys.stderr,
        flush=True)
  server.run()
