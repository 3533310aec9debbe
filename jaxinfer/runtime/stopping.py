"""When a request is done: stop token or EOS, a complete structured-output grammar, a stop
string (cutting the text), or max_tokens. Host side; imports no JAX."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from jaxinfer.runtime.request import Request


def make_stop_check(tokenizer, eos_token_ids: Sequence[int]) -> Callable[[Request], Optional[str]]:
  """stop token / EOS -> "stop"; a stop string cuts the text -> "stop"; max_tokens -> "length".
  The output is detokenized only where it is needed: every token for a request with stop
  strings, otherwise once, when the request finishes (decoding the whole output on every
  step made each step's host work grow with the output length)."""
  eos = set(eos_token_ids)

  def check(r: Request) -> Optional[str]:
    sp = r.sampling
    last = r.output_token_ids[-1]
    reason = None
    if last in sp.stop_token_ids or (not sp.ignore_eos and last in eos):
      reason = "stop"
    elif r.grammar is not None:  # structured output: the grammar follows every token
      g = r.grammar.advance(last)
      if g == "stop":  # complete: nothing but the end of the text may follow
        reason = "stop"
      elif g is not None:  # cannot happen for a token sampled under the mask
        r.error = g
        reason = "constraint"
    if reason is None and sp.stop and tokenizer is not None:
      text = tokenizer.decode(r.output_token_ids)
      for s in sp.stop:
        i = text.find(s)
        if i >= 0:
          r.text = text[:i]
          return "stop"
    if reason is None and len(r.output_token_ids) >= sp.max_tokens:
      reason = "length"
    if reason is not None and tokenizer is not None:
      r.text = tokenizer.decode(r.output_token_ids)
    return reason

  return check
