"""The engine's own thread: the one owner of the Engine, fed through a command queue.

HTTP handlers (the asyncio event loop) never touch engine state. They validate a request
(reads of immutable configuration only), hand it over with `submit`, and read updates
from an `asyncio.Queue` the engine thread fills with `loop.call_soon_threadsafe`. Aborts
(a client that went away) travel the same command queue. The loop:

    drain commands (add / abort / stop)    -> engine.add_request / engine.abort
    engine.step() while there is work       -> one scheduled step (one owner)
    publish: text deltas, finishes, metrics -> per-request queues, Prometheus
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from typing import Callable, Dict, List, Optional

from jaxinfer.config import SamplingParams
from jaxinfer.serving.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Update:
  """What one request produced since the last update. `finish_reason` is set on the last
  one: stop | length | abort | rejected | error (with `error` saying why)."""
  text: str
  token_ids: List[int]
  logprobs: List[float]
  finish_reason: Optional[str] = None
  error: Optional[str] = None
  top_logprobs: List[list] = dataclasses.field(default_factory=list)  # when asked for


class QueueFullError(RuntimeError):
  """More requests wait for admission than --max_queue allows (HTTP 429)."""


@dataclasses.dataclass
class _Track:
  rid: str
  deliver: Callable[[Update], None]
  detok: Optional[IncrementalDetokenizer]
  request: object = None
  sent: int = 0  # output tokens already delivered
  waiting: bool = True  # counted in the admission queue


class EngineService:
  """Runs `engine` on a dedicated thread. `metrics` (optional) is a ServerMetrics."""

  def __init__(self, engine, *, max_queue: int = 1024, metrics=None,
               idle_wait_s: float = 0.02):
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    self.engine = engine
    self.tokenizer = engine.tokenizer
    self.max_queue = max_queue
    self.metrics = metrics
    self.idle_wait_s = idle_wait_s
    self._cmds: "queue.SimpleQueue" = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._queued = 0  # submitted, not yet admitted (or finished): guarded by _lock
    self._ids = itertools.count()
    self._tracks: Dict[str, _Track] = {}  # engine thread only
    self._stopping = threading.Event()
    self.draining = False  # set by drain(): submit refuses
    self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
    self.error: Optional[BaseException] = None  # set if the loop itself died

  # --- any thread --------------------------------------------------------------------------
  def start(self) -> "EngineService":
    self._thread.start()
    return self

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and not self._stopping.is_set()

  @property
  def num_queued(self) -> int:
    with self._lock:
      return self._queued

  def submit(self, prompt_token_ids: List[int], sampling: SamplingParams,
             deliver: Callable[[Update], None], *, prompt: Optional[str] = None,
             deadline_s: Optional[float] = None, stream_text: bool = True) -> str:
    """Queue a request that `engine.validate_request` accepted; returns its id. `deliver`
    is called on the engine thread (make it thread-safe, e.g. call_soon_threadsafe).
    Raises QueueFullError (nothing queued) past max_queue waiting requests."""
    if not self.alive:
      raise RuntimeError("the engine is not running")
    if self.draining:
      raise RuntimeError("the server is shutting down: no new requests")
    with self._lock:
      if self._queued >= self.max_queue:
        raise QueueFullError(f"{self._queued} requests are waiting for admission; the queue "
                             f"holds at most {self.max_queue} (--max_queue)")
      self._queued += 1
    rid = f"req-{next(self._ids)}"
    detok = (IncrementalDetokenizer(self.tokenizer, sampling.stop)
             if stream_text and self.tokenizer is not None else None)
    self._cmds.put(("add", _Track(rid, deliver, detok),
                    (prompt_token_ids, sampling, prompt, deadline_s)))
    return rid

  def abort(self, rid: str) -> None:
    """Cancel a request (e.g. its client disconnected); its pages are freed by the engine
    thread. Unknown or finished ids are ignored."""
    self._cmds.put(("abort", rid, None))

  def drain(self) -> None:
    """Refuse new requests from now on; the ones already submitted run on."""
    self.draining = True

  def abort_all(self, why: str) -> None:
    """End every submitted request now: each client gets finish_reason "abort" with `why`
    (a drain that ran out of time); the engine serves on, empty."""
    self._cmds.put(("abort_all", why, None))

  def shutdown(self, timeout: float = 30.0) -> None:
    """Stop the loop: queued and running requests are aborted (their clients get
    finish_reason "abort"), the thread exits."""
    self._stopping.set()
    self._cmds.put(("stop", None, None))
    if self._thread.is_alive() and threading.current_thread() is not self._thread:
      self._thread.join(timeout)

  # --- engine thread ------------------------------------------------------------------------
  def _dequeue(self, t: _Track) -> None:
    if t.waiting:
      t.waiting = False
      with self._lock:
        self._queued -= 1

  def _handle(self, cmd, a, b) -> None:
    eng = self.engine
    if cmd == "add":
      t: _Track = a
      ids, sp, prompt, deadline_s = b
      try:
        t.request = eng.add_request(ids, sp, request_id=t.rid, prompt=prompt,
                                    deadline_s=deadline_s)
      except Exception as e:  # noqa: BLE001 -- validated before; report, never crash
        self._dequeue(t)
        t.deliver(Update("", [], [], "error", f"{type(e).__name__}: {e}"))
        return
      self._tracks[t.rid] = t
    elif cmd == "abort":
      if a in self._tracks:
        eng.abort(a)
    elif cmd == "abort_all":
      self._abort_all(a, refuse_pending=False)  # what follows in the queue stays

  def _publish(self) -> None:
    done = []
    for rid, t in self._tracks.items():
      r = t.request
      if t.waiting and (r.first_admitted_at is not None or r.state.done):
        self._dequeue(t)
      n = len(r.output_token_ids)
      finished = r.state.done
      if n == t.sent and not finished:
        continue
      new = r.output_token_ids[t.sent:n]
      lps = r.logprobs[t.sent:n]
      tops = r.top_logprobs[t.sent:n]
      t.sent = n
      text = ""
      if t.detok is not None:  # at the end, the engine's text (cut at a stop string) rules
        text = t.detok.finish(r.text or "") if finished else t.detok.push(new)
      if finished:
        self._dequeue(t)
        done.append(rid)
        upd = Update(text, new, lps, r.finish_reason, r.error or r.reject_reason, tops)
        if self.metrics is not None:
          self.metrics.on_finish(r)
      else:
        upd = Update(text, new, lps, top_logprobs=tops)
      try:
        t.deliver(upd)
      except Exception:  # noqa: BLE001 -- a closed event loop must not stop the engine
        log.exception("delivering an update for %s failed", rid)
    for rid in done:
      del self._tracks[rid]

  def _loop(self) -> None:
    eng = self.engine
    idle = False  # the last step ran nothing (e.g. admission waits on pages): don't spin
    try:
      while True:
        try:
          block = idle or not eng.has_unfinished()
          cmd = self._cmds.get(timeout=self.idle_wait_s) if block else self._cmds.get_nowait()
        except queue.Empty:
          cmd = None
        handled = cmd is not None
        while cmd is not None:
          if cmd[0] == "stop":
            self._abort_all()
            return
          self._handle(*cmd)
          try:
            cmd = self._cmds.get_nowait()
          except queue.Empty:
            cmd = None
        idle = False
        if eng.has_unfinished():
          before = eng.num_steps
          events = eng.step()
          ran = eng.num_steps - before  # a router's step may finish one per replica
          idle = not ran and not events
          if ran and self.metrics is not None:
            for record in eng.steps[-ran:]:
              self.metrics.on_step(record, eng)
        elif handled and self.metrics is not None:  # e.g. an abort freed pages
          self.metrics.refresh(eng)
        self._publish()
    except BaseException as e:  # noqa: BLE001 -- the loop died: fail everything, say why
      log.exception("the engine loop stopped")
      self.error = e
      self._stopping.set()
      msg = f"engine stopped: {type(e).__name__}: {e}"
      for t in list(self._tracks.values()):
        self._dequeue(t)
        t.deliver(Update("", [], [], "error", msg))
      self._tracks.clear()
      self._refuse_pending("error", msg)

  def _abort_all(self, why: str = "the server is shutting down",
                 refuse_pending: bool = True) -> None:
    self.engine.abort_requests(list(self._tracks))
    for t in self._tracks.values():  # say why in each client's last update
      if t.request is not None and not t.request.error:
        t.request.error = why
    self._publish()
    if refuse_pending:
      self._refuse_pending("abort", why)

  def _refuse_pending(self, reason: str, msg: str) -> None:
    """Answer the requests submitted but never added (their clients would wait forever)."""
    while True:
      try:
        cmd = self._cmds.get_nowait()
      except queue.Empty:
        return
      if cmd[0] == "add":
        self._dequeue(cmd[1])
        cmd[1].deliver(Update("", [], [], reason, msg))
