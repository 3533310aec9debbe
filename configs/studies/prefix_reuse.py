"""experiments.prefix_reuse (chapter 8.3.3-8.3.4): agent sessions and the prefix cache.

  python -m experiments.prefix_reuse --config=configs/studies/prefix_reuse.py[:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.executors = ("sim", "jax")
  c.strategies = ("append", "rewrite_head", "summarize")
  c.rounds = 12  # agent rounds per session
  # sim (Qwen3-8B, RTX PRO 6000): (KV pool GiB, host-tier pages); 6 GiB keeps the
  # session's prefix, 1 GiB loses part of it to the interfering requests.
  c.sim_pools = ((6.0, 0), (1.0, 0), (1.0, 2000))
  # jax (SmolLM2 on this CPU, session scaled by jax_scale): (pool tokens, host pages)
  c.model = "smollm2-135m-instruct"
  c.jax_scale = 1 / 16
  c.jax_pools = ((4096, 0), (512, 0), (512, 64))
  # data parallelism: dp_sessions sessions at once over dp_replicas simulated replicas
  # (each a dp_pool_gib KV pool), routed by longest prefix or round robin
  c.dp_routing = ("prefix", "round_robin")
  c.dp_replicas = 4
  c.dp_sessions = 8
  c.dp_pool_gib = 6.0
  if mode == "small":
    c.dp_replicas = 2
    c.dp_sessions = 3
    c.executors = ("jax",)
    c.rounds = 3
    c.strategies = ("append", "rewrite_head")
    c.jax_scale = 1 / 48
    c.jax_pools = ((1024, 0),)
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '' or 'small'")
  return c
