"""experiments.preemption (chapter 8.3.2): preemption under a small pool, and cancellation.

  python -m experiments.preemption --config=configs/studies/preemption.py[:small]
"""
import ml_collections

from experiments.chapter import load_config


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.json = False
  # 1. Simulated Qwen3-8B (BF16 KV, RTX PRO 6000 roofline), pools of the chapter's sizes;
  # admission reserves only each request's first step (reserve="none"), so a pool that
  # admits the prompts but not their growth preempts. The pools and the workload standing
  # in for the chapter's (which it does not give) are the chapter config's
  # (configs/chapter/s8_3.py, preempt_*).
  ch = load_config("8.3").inputs
  c.sim_model = ch.model
  c.pools_gib = tuple(ch.preempt_pools_gib)
  c.num_requests = ch.preempt_requests
  c.input_tokens = ch.preempt_input
  c.output_tokens = ch.preempt_output
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
