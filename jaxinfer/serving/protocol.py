"""OpenAI request bodies -> (prompts, SamplingParams), checked field by field.

Every error is an ApiError carrying the HTTP status and an OpenAI error object: the
field (`param`), its value and the limit. Fields the engine cannot honour yet are
refused with a 400 that says so, never silently ignored (e.g. presence_penalty=0.5).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Optional, Tuple

from jaxinfer.config import SamplingParams


class ApiError(Exception):

  def __init__(self, status: int, message: str, param: Optional[str] = None,
               type_: str = "invalid_request_error", code: Optional[str] = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                   type_, code)

  def body(self) -> Dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(param: str, message: str) -> ApiError:
  return ApiError(400, message, param)


def _num(body, name, default, lo=None, hi=None, integer=False):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, numbers.Real) or (
      integer and not isinstance(v, numbers.Integral)) or not math.isfinite(v):
    kind = "an integer" if integer else "a finite number"
    raise bad(name, f"{name} must be {kind}, got {v!r}")
  if lo is not None and v < lo:
    raise bad(name, f"{name} = {v} is below the minimum {lo}")
  if hi is not None and v > hi:
    raise bad(name, f"{name} = {v} is above the maximum {hi}")
  return int(v) if integer else float(v)


def _unsupported(body, name, neutral, why="not supported by this server yet"):
  """A field the engine cannot honour: its neutral value passes, anything else is a 400."""
  v = body.get(name)
  if v is None or v == neutral:
    return
  raise bad(name, f"{name} = {v!r} is {why} (only {neutral!r} is accepted)")


def sampling_from_body(body: Dict[str, Any], *, chat: bool, max_model_len: int,
                       default_max_tokens: int) -> Tuple[int, SamplingParams, dict]:
  """-> (n, SamplingParams for choice 0, extras). max_tokens: `max_completion_tokens`
  (chat) or `max_tokens`; unset means the completions default of 16 (OpenAI) or, for
  chat, `default_max_tokens` (the rest of the context window is checked later)."""
  mt_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
      else "max_tokens"
  max_tokens = _num(body, mt_name, None, lo=1, hi=max_model_len, integer=True)
  if max_tokens is None:
    max_tokens = default_max_tokens if chat else 16
  temperature = _num(body, "temperature", 1.0, lo=0.0, hi=2.0)
  top_p = _num(body, "top_p", 1.0, lo=0.0, hi=1.0)
  if top_p == 0.0:
    raise bad("top_p", "top_p must be > 0 (it is the probability mass kept)")
  top_k = _num(body, "top_k", 0, lo=-1, integer=True)
  n = _num(body, "n", 1, lo=1, hi=16, integer=True)
  seed = _num(body, "seed", None, lo=-2**63, hi=2**64 - 1, integer=True)
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
    if len(stop) > 4:
      raise bad("stop", f"stop has {len(stop)} strings; at most 4 are allowed")
    stop = tuple(stop)
  else:
    raise bad("stop", f"stop must be a string or a list of strings, got {stop!r}")
  if any(not s for s in stop):
    raise bad("stop", "stop strings must not be empty")
  ignore_eos = body.get("ignore_eos", False)
  if not isinstance(ignore_eos, bool):
    raise bad("ignore_eos", f"ignore_eos must be a boolean, got {ignore_eos!r}")
  stop_ids = body.get("stop_token_ids") or []
  if not isinstance(stop_ids, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in stop_ids):
    raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids, got {stop_ids!r}")
  for name, neutral in (("echo", False), ("suffix", None), ("tools", [])):
    _unsupported(body, name, neutral)
  presence = _num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
  frequency = _num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
  repetition = _num(body, "repetition_penalty", 1.0, lo=0.0)
  if repetition == 0.0:
    raise bad("repetition_penalty", "repetition_penalty must be > 0 (1 = off)")
  min_p = _num(body, "min_p", 0.0, lo=0.0, hi=1.0)
  min_tokens = _num(body, "min_tokens", 0, lo=0, hi=max_tokens, integer=True)
  logit_bias = body.get("logit_bias") or {}
  if not isinstance(logit_bias, dict):
    raise bad("logit_bias", f"logit_bias must map token ids to biases, got {logit_bias!r}")
  bias = {}
  for k, v in logit_bias.items():  # JSON keys are strings: "50256": -100
    try:
      tok = int(k)
    except (TypeError, ValueError):
      raise bad("logit_bias", f"logit_bias key {k!r} is not a token id") from None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100 <= v <= 100:
      raise bad("logit_bias", f"logit_bias[{k}] = {v!r} must be a number in [-100, 100]")
    bias[tok] = float(v)
  if body.get("best_of") not in (None, 1, n):
    raise bad("best_of", f"best_of = {body['best_of']!r} is not supported (only best_of == n)")
  # logprobs: the sampled token's, and top-N alternatives per token (N <= 20).
  if chat:
    want_lp = body.get("logprobs", False)
    if not isinstance(want_lp, bool):
      raise bad("logprobs", f"logprobs must be a boolean, got {want_lp!r}")
    top_n = _num(body, "top_logprobs", 0, lo=0, hi=20, integer=True)
    if top_n and not want_lp:
      raise bad("top_logprobs", "top_logprobs needs logprobs: true")
  else:
    lp = _num(body, "logprobs", None, lo=0, hi=20, integer=True)
    want_lp, top_n = lp is not None, lp or 0
  constraint, constraint_param = constraint_from_body(body)
  try:
    sp = SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p, seed=seed,
                        max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(stop_ids),
                        ignore_eos=ignore_eos, min_p=min_p, presence_penalty=presence,
                        frequency_penalty=frequency, repetition_penalty=repetition,
                        min_tokens=min_tokens, logit_bias=bias or None,
                        logprobs=top_n or None, **constraint)
  except ValueError as e:
    param = constraint_param if constraint and any(
        k in str(e) for k in ("json", "regex", "grammar", "choice", "constraint")) else \
        str(e).split()[0]
    raise bad(param, str(e)) from None
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise bad("stream", f"stream must be a boolean, got {stream!r}")
  opts = body.get("stream_options") or {}
  if not isinstance(opts, dict):
    raise bad("stream_options", f"stream_options must be an object, got {opts!r}")
  if not isinstance(opts.get("include_usage", False), bool):
    raise bad("stream_options.include_usage", "stream_options.include_usage must be a "
              f"boolean, got {opts['include_usage']!r}")
  deadline = _num(body, "deadline_s", None, lo=1e-3)
  return n, sp, {"logprobs": want_lp, "stream": stream,
                 "include_usage": opts.get("include_usage", False),
                 "deadline_s": deadline, "max_tokens_given": body.get(mt_name) is not None,
                 "constraint_param": constraint_param}


# vLLM's structured-output extras -> SamplingParams fields (the older guided_* names and
# the newer structured_outputs object).
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "json_object": "json_object"}


def constraint_from_body(body: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[str]]:
  """The request's structured-output constraint as SamplingParams fields, and the body
  field it came from: OpenAI's response_format (text | json_object | json_schema), vLLM's
  guided_json / guided_regex / guided_choice / guided_grammar and structured_outputs.
  More than one is a 400; whether the grammar compiles is checked with the request."""
  found: Dict[str, Any] = {}
  params = []
  rf = body.get("response_format")
  if rf is not None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
      raise bad("response_format", "response_format must be {\"type\": \"text\"}, "
                "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                f"{{\"name\": ..., \"schema\": {{...}}}}}}, got {rf!r}")
    if rf["type"] == "json_object":
      found["json_object"] = True
      params.append("response_format")
    elif rf["type"] == "json_schema":
      js = rf.get("json_schema")
      schema = js.get("schema") if isinstance(js, dict) else None
      if not isinstance(schema, dict):
        raise bad("response_format", "response_format.json_schema.schema must be a JSON "
                  f"Schema object, got {schema!r}")
      found["json_schema"] = schema
      params.append("response_format")
  for name, field in _GUIDED.items():
    if body.get(name) is not None:
      found[field] = body[name]
      params.append(name)
  so = body.get("structured_outputs")
  if so is not None:
    if not isinstance(so, dict):
      raise bad("structured_outputs", f"structured_outputs must be an object, got {so!r}")
    for key, v in so.items():
      if key not in _STRUCTURED:
        raise bad("structured_outputs", f"structured_outputs.{key} is not supported (one of "
                  f"{sorted(_STRUCTURED)})")
      if v is not None and v is not False:
        found[_STRUCTURED[key]] = v
        params.append(f"structured_outputs.{key}")
  backend = body.get("guided_decoding_backend")
  if backend not in (None, "auto", "guidance", "llguidance"):
    raise bad("guided_decoding_backend", f"guided_decoding_backend = {backend!r}: this server "
              "compiles grammars with llguidance only ('guidance', 'llguidance' or 'auto')")
  if len(params) > 1:
    raise bad(params[1], f"at most one structured-output constraint per request, got "
              f"{', '.join(params)}")
  return found, (params[0] if params else None)


def messages_from_body(body: Dict[str, Any]) -> List[Dict[str, str]]:
  """Chat messages as [{"role", "content": str}]; content parts of type text are joined."""
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise bad("messages", "messages must be a non-empty list of {role, content} objects")
  out = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict):
      raise bad(f"messages[{i}]", f"messages[{i}] must be an object, got {m!r}")
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "developer", "user", "assistant"):
      raise bad(f"messages[{i}].role", f"messages[{i}].role = {role!r}: expected system, "
                "developer, user or assistant")
    if isinstance(content, list):
      parts = []
      for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"),
                                                                                  str):
          raise bad(f"messages[{i}].content[{j}]", "only text content parts are supported")
        parts.append(p["text"])
      content = "".join(parts)
    if not isinstance(content, str):
      raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
    out.append({"role": "system" if role == "developer" else role, "content": content})
  return out


def prompts_from_body(body: Dict[str, Any]) -> List[Any]:
  """Completions `prompt`: a string, a list of strings, a list of token ids, or a list of
  lists of token ids -> a list of prompts (str or list of int)."""
  p = body.get("prompt")
  if isinstance(p, str):
    return [p]
  if isinstance(p, list) and p:
    if all(isinstance(x, str) for x in p):
      return list(p)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
      return [list(p)]
    if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in x) for x in p):
      return [list(x) for x in p]
  raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a "
            "list of lists of token ids (non-empty)")
