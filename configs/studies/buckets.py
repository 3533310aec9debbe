"""experiments.buckets (chapter 8.2.4): bucket strategies — executables, compile time,
padding, step time, TTFT and ITL — on real SmolLM2 and simulated at Qwen3-8B scale.

  python -m experiments.buckets --config=configs/studies/buckets.py[:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.trace = "configs/traces/chat_synthetic.jsonl"  # shipped synthetic chat lengths
  # Fixed ladders, and tables fitted to the trace under these caps on executables.
  c.strategies = ("pow2", "pow4", "linear", "exact")
  c.fitted_caps = (12, 24, 55)
  c.max_sizes = 5  # sizes per axis the fitted search tries
  # Simulated (cost model): every trace request, each table, with and without charging a
  # compile the first time a shape runs (no warm-up; seconds per compile measured below
  # on this CPU, or sim_compile_s when the real part is off).
  c.sim_targets = ("smollm2-135m-instruct@local-cpu", "qwen3-8b@rtx-pro-6000")
  # (trace, step token budget = largest token bucket, largest request bucket): the
  # shipped chat trace, and chapter 8.2.4's replay (six 2048-token prompts every 80 ms)
  c.sim_traces = (("chat", 256, 64), ("ch8_2_4", 2048, 8))
  c.sim_requests = 200  # of the chat trace
  c.sim_compile_s = 2.6
  # Real SmolLM2 on this machine: the first real_requests of the trace, prompts and
  # outputs capped, all arriving at once; tables that stay under real_max_shapes.
  c.real = True
  c.real_strategies = ("pow4", "fitted:24", "pow2")
  c.real_requests = 24
  c.real_max_prompt = 192
  c.real_max_output = 24
  c.real_max_tokens = 128
  c.real_max_seqs = 16
  c.real_max_shapes = 160
  c.real_max_model_len = 512
  if mode == "small":
    c.fitted_caps = (12,)
    c.max_sizes = 3
    c.sim_targets = ("smollm2-135m-instruct@local-cpu",)
    c.sim_traces = (("chat", 256, 64),)
    c.sim_requests = 24
    c.real_strategies = ("fitted:6",)
    c.real_requests = 3
    c.real_max_prompt = 40
    c.real_max_output = 3
    c.real_max_tokens = 32
    c.real_max_seqs = 2
  elif mode:
    raise ValueError(f"unknown config mode {mode!r} (use '' or 'small')")
  return c
