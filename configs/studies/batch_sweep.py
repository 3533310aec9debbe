"""experiments.batch_sweep (chapter 8-1, 8.6.3): batch sweep, real with peers and simulated.

  python -m experiments.batch_sweep --config=configs/studies/batch_sweep.py[:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"
  c.batches = (1, 4, 16, 64)  # requests sent at once (real model)
  c.prompt_len = 128
  c.output_tokens = 32
  c.peers = True  # HF transformers / llama.cpp on the same weights, where installed
  c.sim_batches = (1, 4, 16, 64)  # Qwen3-8B on RTX PRO 6000 (2K in, 256 out)
  c.sim_token_budget = 8192
  if mode == "small":
    c.batches = (1, 4)
    c.output_tokens = 8
    c.peers = False
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '' or 'small'")
  return c
