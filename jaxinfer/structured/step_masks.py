"""One step's token masks: which logits rows a grammar or min_tokens constrains, and the
function that fills them (called by the executor once the forward is dispatched, so the
host fills the masks while the device computes). Host side; imports no JAX."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from jaxinfer.structured.grammar import unconstrained_rows


def mask_filler(seqs, num_rows: int, vocab_size: int, compiler: Callable[[], object],
                eos_token_ids: Sequence[int],
                on_dead: Callable[[object, str], None]) -> Optional[Callable[[], np.ndarray]]:
  """seqs: the step's ScheduledSeqs in logits-row order. None when no row is constrained
  (the step then runs without masking); else a function returning the packed
  allowed-token rows ([num_rows, words] int32, all ones for free requests and padding):
  each grammar's next tokens (and after each of its drafts), and, while a request is
  short of min_tokens, everything but EOS and its stop ids. A request whose row allows
  no token goes to on_dead(request, why): it must end without emitting (its row is reset
  to all ones, so the step still samples something finite, which is discarded)."""
  rows, short, n = [], [], 0
  for s in seqs:
    if s.request.grammar is not None and s.num_logits:
      rows.append((s, n))
    if s.num_logits and len(s.request.output_token_ids) < s.request.sampling.min_tokens:
      short.append((s, n))
    n += s.num_logits
  if not rows and not short:
    return None

  def fill() -> np.ndarray:
    mask = unconstrained_rows(num_rows, vocab_size)
    if rows:
      compiler().fill([(s.request.grammar, i, s.draft) for s, i in rows], mask)
    bits = mask.view(np.uint32)
    for s, i in short:  # min_tokens: nothing may end the output yet
      sp = s.request.sampling
      ends = set(eos_token_ids) | set(sp.stop_token_ids)
      for j in range(s.num_logits):
        if len(s.request.output_token_ids) + j < sp.min_tokens:
          for t in ends:
            bits[i + j, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    for s, i in rows + short:
      r = s.request
      if r.state.done or mask[i].any():
        continue
      mask[i:i + s.num_logits] = -1
      g = r.grammar
      why = ((g.error if g is not None else None) or
             f"no token satisfies the {g.kind if g is not None else 'min_tokens'} constraint "
             f"after {len(r.output_token_ids)} output tokens")
      on_dead(r, why)
    return mask

  return fill
