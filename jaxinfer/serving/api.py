"""The OpenAI-compatible HTTP front (FastAPI): /v1/chat/completions, /v1/completions,
/v1/models, /health, /metrics.

Handlers run on the asyncio event loop and never touch the engine: they validate, hand
requests to the EngineService (the engine's own thread) and await updates on an
asyncio.Queue. A client that disconnects aborts its requests, which frees their pages.
Streams are server-sent events (`data: {chunk}` ... `data: [DONE]`) with OpenAI's chunk
objects; every JSON body is strict (no NaN / Infinity).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from jaxinfer import strict_json
from jaxinfer.runtime.engine import RequestTooLargeError
from jaxinfer.structured.grammar import ConstraintError
from jaxinfer.serving.engine_thread import EngineService, QueueFullError, Update
from jaxinfer.serving.protocol import (ApiError, bad, messages_from_body, prompts_from_body,
                                       sampling_from_body)

_DISCONNECT_POLL_S = 0.25
_POLL = object()  # in a stream's queue: time to ask whether its client is still there


def _json(status: int, body: Dict[str, Any]) -> Response:
  return Response(strict_json.dumps(body), status_code=status, media_type="application/json")


def _sse(obj) -> str:
  return f"data: {strict_json.dumps(obj)}\n\n"


class _Poller:
  """Puts a _POLL in a stream's queue when nothing came for _DISCONNECT_POLL_S, until
  stopped: a waiting stream notices a client that went away, without a timer per
  update."""

  def __init__(self, q: asyncio.Queue):
    self.q = q
    self.loop = asyncio.get_running_loop()
    self.quiet = True  # nothing taken from q since the last tick (see _next)
    self.handle = self.loop.call_later(_DISCONNECT_POLL_S, self._tick)

  def _tick(self) -> None:
    if self.quiet:
      self.q.put_nowait(_POLL)
    self.quiet = True
    self.handle = self.loop.call_later(_DISCONNECT_POLL_S, self._tick)

  def stop(self) -> None:
    self.handle.cancel()


def build_app(service: EngineService, llm, *, model_name: str, api_key: Optional[str] = None,
              default_max_tokens: int = 512, metrics=None,
              default_deadline_s: Optional[float] = None,
              max_body_bytes: int = 16 << 20, max_prompt_chars: int = 2_000_000) -> FastAPI:
  """`llm`: the LLM whose engine `service` runs; its prompt encoding and chat template
  are used here (they read no engine state). Work that grows with the input (JSON
  parsing, chat templating, tokenizing, grammar compilation) runs on worker threads, never
  on the event loop; a body over max_body_bytes is a 413 before the rest is read, a
  prompt over max_prompt_chars characters a 400 before it is tokenized."""
  app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, openapi_url=None)
  created = int(time.time())
  tokenizer, max_model_len = llm.tokenizer, llm.max_model_len

  def _error(e: ApiError) -> Response:
    if metrics is not None:
      metrics.rejected(e.status)
    return _json(e.status, e.body())

  def _check_auth(request: Request) -> None:
    if api_key is None:
      return
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
      raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                     type_="authentication_error", code="invalid_api_key")

  async def _read_body(request: Request) -> bytes:
    """The body, or a 413 as soon as it is known to exceed max_body_bytes (from its
    Content-Length before reading anything, else while reading)."""
    too_big = ApiError(413, f"the request body exceeds {max_body_bytes} bytes "
                       "(--max_body_bytes)", type_="invalid_request_error",
                       code="payload_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
      raise too_big
    parts, n = [], 0
    async for chunk in request.stream():
      n += len(chunk)
      if n > max_body_bytes:
        raise too_big
      parts.append(chunk)
    return b"".join(parts)

  def _parse(raw: bytes) -> Dict[str, Any]:
    try:
      body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
      raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name and (not isinstance(model, str) or
                                model not in llm.executor.lora_adapters):
      served = [model_name] + sorted(llm.executor.lora_adapters)
      raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                     f"{served} (a LoRA adapter by its name)", "model",
                     code="model_not_found")
    return body

  def _check_chars(n: int, param: str) -> None:
    if n > max_prompt_chars:
      raise bad(param, f"the prompt has {n} characters; the limit is {max_prompt_chars} "
                "(--max_prompt_chars)")

  def _encode(prompt, param: str) -> List[int]:
    if isinstance(prompt, str):
      _check_chars(len(prompt), param)
    try:
      return llm.encode_prompt(prompt)
    except ValueError as e:
      raise bad(param, str(e)) from None

  def _validate(ids: List[int], sp, extras):
    if not extras["max_tokens_given"]:  # default: whatever fits the context, up to the cap
      room = max_model_len - len(ids)
      if room < 1:
        raise bad("messages", f"the prompt has {len(ids)} tokens; the context window holds "
                  f"{max_model_len}")
      if sp.max_tokens > room:
        sp = dataclasses.replace(sp, max_tokens=room)
    try:
      service.engine.validate_request(ids, sp)
    except RequestTooLargeError as e:
      raise bad("max_tokens" if "max_tokens" in str(e) else "prompt", str(e)) from None
    except ConstraintError as e:  # does not compile, admits no string, or is too large
      raise bad(extras["constraint_param"], str(e)) from None
    except ValueError as e:
      raise bad("logit_bias" if str(e).startswith("logit_bias") else "prompt", str(e)) from None
    return sp

  async def _start(request: Request, prompts: List[List[int]], sps, extras, texts):
    """Submit every choice (all validated first); -> (ids, queue). 429 / 503 on refusal."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    rids = []
    try:
      for i, (ids, sp) in enumerate(zip(prompts, sps)):
        def deliver(u: Update, i=i):
          loop.call_soon_threadsafe(q.put_nowait, (i, u))
        rids.append(service.submit(ids, sp, deliver, prompt=texts[i],
                                   deadline_s=extras["deadline_s"] or default_deadline_s))
    except QueueFullError as e:
      for rid in rids:
        service.abort(rid)
      raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
    except RuntimeError as e:
      for rid in rids:
        service.abort(rid)
      raise ApiError(503, str(e), type_="service_unavailable") from None
    return rids, q

  async def _next(request: Request, q: asyncio.Queue, poller: _Poller):
    """The next update of a stream, or None if the client disconnected meanwhile (asked
    each _DISCONNECT_POLL_S by a _Poller's _POLL in the queue; the response also
    stops when a write finds the client gone)."""
    while True:
      item = await q.get()
      if item is not _POLL:
        poller.quiet = False
        return item
      if await request.is_disconnected():
        return None

  def _watch(request: Request, q: asyncio.Queue) -> "asyncio.Future":
    """A task that puts None in q when the client disconnects (cancel it when done)."""
    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(lambda f: None if f.cancelled() else q.put_nowait(None))
    return gone

  def _refusal(u: Update) -> Optional[ApiError]:
    if u.finish_reason == "rejected":
      return ApiError(503, f"rejected by deadline admission (8.6.1): it cannot finish "
                      f"within its deadline ({u.error})", type_="service_unavailable",
                      code="deadline")
    if u.finish_reason == "error":
      return ApiError(500, f"the request failed: {u.error}", type_="server_error")
    if u.finish_reason == "abort":
      return ApiError(503, f"the request was aborted: {u.error or 'cancelled'}",
                      type_="service_unavailable")
    return None

  def _piece(t):
    return tokenizer.decode([t], skip_special_tokens=False)

  def _lp_chat(tokens, lps, tops):
    out = []
    for k, (t, lp) in enumerate(zip(tokens, lps)):
      s = _piece(t)
      alts = tops[k] if k < len(tops) else []
      out.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                  "top_logprobs": [{"token": _piece(a), "logprob": alp,
                                    "bytes": list(_piece(a).encode("utf-8"))}
                                   for a, alp in alts]})
    return out

  def _lp_completion(tokens, lps, tops):
    toks = [_piece(t) for t in tokens]
    top = None
    if tops:  # one {token text: logprob} per token (pieces that decode alike merge)
      top = [{_piece(a): alp for a, alp in reversed(alts)} for alts in tops]
    return {"tokens": toks, "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": []}

  async def _run(request: Request, chat: bool):
    raw = await _read_body(request)
    prompts, sps, texts, extras = await asyncio.to_thread(_prepare, raw, chat)
    kind = "chatcmpl" if chat else "cmpl"
    rid = f"{kind}-{uuid.uuid4().hex}"
    rids, q = await _start(request, prompts, sps, extras, texts)
    if extras["stream"]:
      return StreamingResponse(_stream(request, rid, chat, rids, q, extras),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    return await _collect(request, rid, chat, rids, q, extras)

  def _prepare(raw: bytes, chat: bool):
    """Body bytes -> (prompt ids, SamplingParams, prompt texts, extras), every choice
    validated; on a worker thread (ApiError for the client)."""
    body = _parse(raw)
    n, sp0, extras = sampling_from_body(body, chat=chat, max_model_len=max_model_len,
                                        default_max_tokens=default_max_tokens)
    extras["model"] = body.get("model", model_name)
    if extras["model"] != model_name:  # a LoRA adapter's name (8.2.1), as vLLM serves them
      sp0 = dataclasses.replace(sp0, lora=extras["model"])
    if chat:
      msgs = messages_from_body(body)
      _check_chars(sum(len(m["content"]) for m in msgs), "messages")
      try:
        text = llm.chat_prompt(msgs)
      except Exception as e:  # noqa: BLE001 -- a template error names the messages
        raise bad("messages", f"the chat template rejected the messages: {e}") from None
      base = [(text, _encode(text, "messages"))]
    else:
      base = [(p if isinstance(p, str) else None, _encode(p, "prompt"))
              for p in prompts_from_body(body)]
    prompts, sps, texts = [], [], []
    extras["prompt_tokens"] = sum(len(ids) for _, ids in base)
    for text, ids in base:
      sp = _validate(ids, sp0, extras)
      for k in range(n):
        seed = None if sp.seed is None else (sp.seed + k) % 2**64
        prompts.append(ids)
        sps.append(dataclasses.replace(sp, seed=seed) if k else sp)
        texts.append(text)
    return prompts, sps, texts, extras

  async def _collect(request, rid, chat, rids, q, extras):
    texts = [""] * len(rids)
    toks: List[List[int]] = [[] for _ in rids]
    lps: List[List[float]] = [[] for _ in rids]
    tops: List[list] = [[] for _ in rids]
    reasons: List[Optional[str]] = [None] * len(rids)
    left = len(rids)
    gone = _watch(request, q)
    try:
      while left:
        item = await q.get()
        if item is None:  # the client went away: free its pages at the next step
          for x in rids:
            service.abort(x)
          return Response(status_code=499)
        i, u = item
        texts[i] += u.text
        toks[i] += u.token_ids
        lps[i] += u.logprobs
        tops[i] += u.top_logprobs
        if u.finish_reason is not None:
          err = _refusal(u)
          if err is not None:
            for x in rids:
              service.abort(x)
            return _error(err)
          reasons[i] = u.finish_reason
          left -= 1
    except asyncio.CancelledError:
      for x in rids:
        service.abort(x)
      raise
    finally:
      gone.cancel()
    choices = []
    for i in range(len(rids)):
      lp = None
      if extras["logprobs"]:
        lp = ({"content": _lp_chat(toks[i], lps[i], tops[i])} if chat else
              _lp_completion(toks[i], lps[i], tops[i]))
      if chat:
        choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                        "logprobs": lp, "finish_reason": reasons[i]})
      else:
        choices.append({"index": i, "text": texts[i], "logprobs": lp,
                        "finish_reason": reasons[i]})
    n_prompt = extras["prompt_tokens"]
    n_out = sum(len(t) for t in toks)
    return _json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                       "created": int(time.time()), "model": extras["model"],
                       "choices": choices,
                       "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                 "total_tokens": n_prompt + n_out}})

  async def _stream(request, rid, chat, rids, q, extras):
    obj = "chat.completion.chunk" if chat else "text_completion"
    t_created = int(time.time())

    def chunk(i, text, reason=None, toks=(), lps=(), tops=(), first=False):
      lp = None
      if extras["logprobs"] and toks:
        lp = ({"content": _lp_chat(toks, lps, tops)} if chat else
              _lp_completion(toks, lps, tops))
      if chat:
        delta = {"role": "assistant", "content": text} if first else (
            {"content": text} if text or reason is None else {})
        c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
      else:
        c = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
      out = {"id": rid, "object": obj, "created": t_created, "model": extras["model"],
             "choices": [c]}
      if extras["include_usage"]:
        out["usage"] = None
      return _sse(out)

    left = len(rids)
    n_out = 0
    finished = False
    poller = _Poller(q)
    try:
      if chat:
        for i in range(len(rids)):
          yield chunk(i, "", first=True)
      while left:
        item = await _next(request, q, poller)
        if item is None:
          return  # disconnected: the finally clause aborts
        i, u = item
        n_out += len(u.token_ids)
        if u.finish_reason is not None:
          err = _refusal(u)
          if err is not None:
            yield _sse(err.body())
            for x in rids:
              service.abort(x)
            break
          last = chunk(i, "", reason=u.finish_reason)
          if u.text or u.token_ids:  # one write for both events
            last = chunk(i, u.text, toks=u.token_ids, lps=u.logprobs, tops=u.top_logprobs) + last
          yield last
          left -= 1
        elif u.text or (extras["logprobs"] and u.token_ids):
          yield chunk(i, u.text, toks=u.token_ids, lps=u.logprobs, tops=u.top_logprobs)
      if extras["include_usage"]:
        n_prompt = extras["prompt_tokens"]
        yield _sse({"id": rid, "object": obj, "created": t_created, "model": extras["model"],
                    "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                             "total_tokens": n_prompt + n_out}})
      yield "data: [DONE]\n\n"
      finished = True
    finally:
      poller.stop()
      if not finished:  # client gone or the response was cancelled: free the pages
        for x in rids:
          service.abort(x)

  async def _endpoint(request: Request, chat: bool):
    try:
      _check_auth(request)
      return await _run(request, chat)
    except ApiError as e:
      return _error(e)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await _endpoint(request, True)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _endpoint(request, False)

  @app.get("/v1/models")
  async def models(request: Request):
    try:
      _check_auth(request)
    except ApiError as e:
      return _error(e)
    base = {"object": "model", "created": created, "owned_by": "jaxinfer",
            "max_model_len": max_model_len}
    return _json(200, {"object": "list", "data": [dict(base, id=model_name, root=model_name,
                                                       parent=None)] + [
        dict(base, id=name, root=a.path or name, parent=model_name)  # LoRA adapters
        for name, a in sorted(llm.executor.lora_adapters.items())]})

  @app.get("/health")
  async def health():
    if not service.alive:
      return _json(503, {"status": "engine stopped",
                         "error": None if service.error is None else repr(service.error)})
    return _json(200, {"status": "ok"})

  @app.get("/metrics")
  async def prometheus():
    if metrics is None:
      return Response(status_code=404)
    return Response(metrics.export(), media_type="text/plain; version=0.0.4")

  return app


async def _disconnected(request: Request) -> None:
  """Returns when the client has gone: the body is read, so the next ASGI message is the
  disconnect."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def _reject_constant(c):
  raise ValueError(f"{c} is not valid JSON")
