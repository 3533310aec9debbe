"""experiments.preemption (chapter 8.3.2): preemption under a small pool, and cancellation.

  python -m experiments.preemption --config=configs/studies/preemption.py[:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.json = False
  # 1. Simulated Qwen3-8B (BF16 KV, RTX PRO 6000 roofline), pools of the chapter's sizes;
  # admission reserves only each request's first step (reserve="none"), so a pool that
  # admits the prompts but not their growth preempts. The chapter gives the pool sizes
  # (1 GiB: one preemption, 1805 extra scheduled tokens; 2 GiB: none) but not the
  # workload: these fields are ours and the study prints them.
  c.sim_model = "qwen3-8b"
  c.pools_gib = (1.0, 2.0)
  c.num_requests = 3
  c.input_tokens = 2304
  c.output_tokens = 256
  # 2. Cancellation on the real model (SmolLM2 on this machine): a request decoding at
  # a long context is cancelled while a step that reads its pages is in flight; abort()'s
  # return time and the time until its pages are free (the step's end).
  c.model = "smollm2-135m-instruct"
  c.cancel_prompt_tokens = 1600
  c.cancel_batch = 8
  c.cancel_repeats = 5
  if mode == "small":
    c.cancel_prompt_tokens = 400
    c.cancel_batch = 4
    c.cancel_repeats = 2
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '' or 'small'")
  return c
