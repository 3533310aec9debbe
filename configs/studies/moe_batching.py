"""experiments.moe_batching: the batching curve of a mixture of experts beside a dense model
of equal active parameters, simulated at full scale and measured on a small random model.

  python -m experiments.moe_batching --config=configs/studies/moe_batching.py[:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.sim_model = "qwen3-30b-a3b"  # priced on the cost model beside its dense twin
  c.sim_hardware = "rtx-pro-6000"
  c.sim_context = 2048  # tokens each request has in context during the decode rounds
  c.sim_batches = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  # the real model: random weights of a small MoE (f32, this CPU) and its dense twin
  c.real = ml_collections.ConfigDict(dict(
      hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
      vocab_size=4096, num_experts=32, experts_per_token=4, moe_intermediate_size=512))
  c.batches = (1, 4, 16, 64)
  c.prompt_len = 32
  c.output_tokens = 16
  if mode == "small":
    c.real.num_layers = 2
    c.real.num_experts = 8
    c.real.moe_intermediate_size = 128
    c.batches = (1, 8)
    c.output_tokens = 4
    c.sim_batches = (1, 8, 64)
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '' or 'small'")
  return c
