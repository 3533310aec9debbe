"""experiments.prefix_reuse (chapter 8.3.3-8.3.4): agent sessions and the prefix cache.

  python -m experiments.prefix_reuse --config=configs/studies/prefix_reuse.py[:small]
"""
import ml_collections

from experiments.chapter import load_config


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.executors = ("sim", "jax")
  c.strategies = ("append", "rewrite_head", "summarize")
  c.rounds = 12  # agent rounds per session
  # The session: the chapter's replay (configs/chapter/s8_3.py, replay_session);
  # session=synthetic: the study's earlier shape (a 1000-token system prompt, 150-token
  # results)
  c.session = ml_collections.ConfigDict(dict(load_config("8.3").inputs.replay_session))
  # sim (Qwen3-8B, RTX PRO 6000): (KV pool GiB, host-tier pages); the chapter's 6 GiB
  # keeps the session's prefix, its 1 GiB loses it to the interfering requests
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
  synthetic = ml_collections.ConfigDict(dict(
      system_tokens=1000, result_tokens=150, reply_tokens=40, interfering=2,
      interfering_tokens=3000))
  if mode == "synthetic":
    c.session = synthetic
  elif mode == "small":  # the synthetic shape: scaled 1/48, the chapter's has no full page
    c.session = synthetic
    c.dp_replicas = 2
    c.dp_sessions = 3
    c.executors = ("jax",)
    c.rounds = 3
    c.strategies = ("append", "rewrite_head")
    c.jax_scale = 1 / 48
    c.jax_pools = ((1024, 0),)
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '', 'synthetic' or 'small'")
  return c
