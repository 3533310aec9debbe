"""Peer engines on the same GGUF weights, for side-by-side runs (optional extras: each
returns None with a message when its package is absent)."""
from __future__ import annotations

import importlib.util
import sys
import time
from typing import List, Optional


def _missing(mods) -> Optional[str]:
  absent = [m for m in mods if importlib.util.find_spec(m) is None]
  return ", ".join(absent) if absent else None


def hf_generate(gguf_path: str, prompts: List[List[int]], new_tokens: int) -> Optional[dict]:
  """HF transformers `generate`, static batch, f32, greedy, equal-length prompts:
  {ttft_s, decode_tok_s, step_ms}."""
  miss = _missing(["torch", "transformers"])
  if miss:
    print(f"HF peer skipped: {miss} not installed (pip install -e '.[test]')", file=sys.stderr)
    return None
  import torch
  from jaxinfer.benchmarking import hf_model
  model = hf_model(gguf_path)
  ids = torch.tensor(prompts)

  def run(n):
    t = time.perf_counter()
    with torch.no_grad():
      model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                     min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t

  run(2)  # warm-up
  t1, tn = run(1), run(new_tokens)
  B = len(prompts)
  return {"ttft_s": t1, "decode_tok_s": B * (new_tokens - 1) / (tn - t1),
          "step_ms": 1e3 * (tn - t1) / (new_tokens - 1),
          "throughput_tok_s": B * new_tokens / tn}


def llama_cpp_generate(gguf_path: str, prompts: List[List[int]], new_tokens: int
                       ) -> Optional[dict]:
  """llama.cpp through llama-cpp-python, one prompt at a time (its native batch-1 path)."""
  miss = _missing(["llama_cpp"])
  if miss:
    print("llama.cpp peer skipped: llama-cpp-python not installed", file=sys.stderr)
    return None
  from llama_cpp import Llama
  llm = Llama(model_path=gguf_path, n_ctx=4096, verbose=False)
  t = time.perf_counter()
  n = 0
  for p in prompts:
    for _ in llm.generate(p, temp=0.0):
      n += 1
      if n % new_tokens == 0:
        break
  dt = time.perf_counter() - t
  return {"throughput_tok_s": n / dt}
