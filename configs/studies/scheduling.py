"""experiments.scheduling (chapter 8.2.2-8.2.4): policies and the token-budget sweep.

  python -m experiments.scheduling --config=configs/studies/scheduling.py[:sim|:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  # sim: Qwen3-8B on RTX PRO 6000 at the chapter's scale; sim_local: the real run's model
  # and scaled trace on the local-cpu roofline; jax: the real engine on this CPU
  c.executors = ("sim", "sim_local", "jax")
  c.json = False  # print the results as JSON instead of tables
  # 1. policies on the 8.2.2 trace
  c.workload = "ch8_2_2"  # or a JSON trace path
  # separate: a new prompt's prefill runs as its own iteration beside the decodes (8.1.1)
  c.policies = ("fixed", "continuous", "separate", "chunked")
  c.max_running = 2
  c.chunk_size = 2048
  c.token_budget = 4096
  # 2. token-budget sweep on the 8.2.4 replay (six requests every 80 ms). The chapter
  # leaves open the requests' lengths and the chunk size: these fields set them (printed
  # with the results). sweep_chunk = 0: the chunk is the budget.
  c.sweep_workload = "ch8_2_4"  # or a JSON trace path (then the four fields below are unused)
  c.sweep_requests = 6
  c.sweep_interval_ms = 80.0
  c.sweep_input_tokens = 2048
  c.sweep_output_tokens = 64
  c.sweep_chunk = 0
  c.sweep_step_model = "affine"  # simulator: "affine" (8.2.2's fit) or "roofline" (8.6.3's)
  c.sweep_budgets = (512, 1024, 2048, 4096, 8192)
  c.sweep_max_running = 8
  # simulator
  c.sim_model = "qwen3-8b"
  c.kv_budget_gib = 12.0
  # real model: the traces scaled down to this CPU (prompt lengths and budgets x
  # token_scale, arrival times x time_scale)
  c.model = "smollm2-135m-instruct"
  c.token_scale = 1 / 16
  c.time_scale = 2.0
  if mode == "sim":
    c.executors = ("sim",)
  elif mode == "small":
    c.policies = ("continuous", "chunked")
    c.sweep_budgets = (512, 8192)
    c.token_scale = 1 / 32
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '', 'sim' or 'small'")
  return c
