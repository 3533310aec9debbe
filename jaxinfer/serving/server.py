"""Assemble and run the server: LLM -> EngineService (engine thread) -> FastAPI app ->
uvicorn. SIGTERM / SIGINT drain: uvicorn stops accepting connections, new requests on open
connections are refused (503), and the requests in flight run on for up to `drain_s`;
then whatever still runs is aborted, so every stream ends with an error event and
`[DONE]` and every other client gets an error object; then the process exits (0 for
SIGTERM)."""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from typing import Optional

import uvicorn

from jaxinfer.serving.api import build_app
from jaxinfer.serving.engine_thread import EngineService
from jaxinfer.serving.prom import ServerMetrics

log = logging.getLogger(__name__)

# uvicorn cancels what is still open this long after a drain's aborts: time for the aborted
# responses to send their last event
DRAIN_GRACE_S = 5.0


def make_app(llm, *, model_name: str, api_key: Optional[str] = None, max_queue: int = 1024,
             default_max_tokens: int = 512, deadline_s: Optional[float] = None,
             max_body_bytes: int = 16 << 20, max_prompt_chars: int = 2_000_000):
  """-> (app, service). The service's thread starts with the app (lifespan) and stops
  with it."""
  metrics = ServerMetrics(model_name)
  if hasattr(llm, "use_serving_policy"):
    llm.use_serving_policy()
  service = EngineService(llm.engine, max_queue=max_queue, metrics=metrics)
  metrics.refresh(llm.engine)
  app = build_app(service, llm, model_name=model_name, api_key=api_key,
                  default_max_tokens=default_max_tokens, metrics=metrics,
                  default_deadline_s=deadline_s, max_body_bytes=max_body_bytes,
                  max_prompt_chars=max_prompt_chars)

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
          deadline_s: Optional[float] = None, drain_s: float = 30.0,
          max_body_bytes: int = 16 << 20, max_prompt_chars: int = 2_000_000,
          log_level: str = "warning") -> None:
  app, service = make_app(llm, model_name=model_name, api_key=api_key, max_queue=max_queue,
                          default_max_tokens=default_max_tokens, deadline_s=deadline_s,
                          max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars)
  config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=drain_s + DRAIN_GRACE_S,
                          access_log=False)
  server = _DrainingServer(config, service, drain_s)
  # uvicorn handles SIGTERM / SIGINT itself (graceful shutdown), then re-raises the signal
  # into the handlers that were installed before it: these make that a clean exit (0 for
  # SIGTERM, 130 for Ctrl-C) instead of death by signal.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
  print(f"[jaxinfer] serving {model_name} on http://{host}:{port}/v1", file=sys.stderr,
        flush=True)
  server.run()


class _DrainingServer(uvicorn.Server):
  """uvicorn's server whose first exit signal also starts the engine's drain: new
  requests are refused at once, and what still runs after drain_s is aborted."""

  def __init__(self, config, service, drain_s: float):
    super().__init__(config)
    self._service, self._drain_s = service, drain_s
    self._drain_timer: Optional[threading.Timer] = None

  def handle_exit(self, sig, frame) -> None:
    if self._drain_timer is None:
      log.warning("signal %s: draining (new requests refused; what runs after %.0f s is "
                  "aborted)", sig, self._drain_s)
      self._service.drain()
      self._drain_timer = threading.Timer(
          self._drain_s, self._service.abort_all,
          (f"the server is shutting down: the drain time of {self._drain_s:g} s ran out",))
      self._drain_timer.daemon = True
      self._drain_timer.start()
    super().handle_exit(sig, frame)
