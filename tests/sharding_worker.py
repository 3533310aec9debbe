"""Runs in subprocesses started by tests/test_sharding.py: the CPU device count (XLA_FLAGS)
and jax.distributed must be set before JAX starts, so these checks cannot share the test
process. Prints one JSON object on its last line.

  python tests/sharding_worker.py tp             # 8 virtual devices: tp 1/2/4, dp 2
  python tests/sharding_worker.py dist PORT ID   # one process of a 2-process tp=2 job
  python tests/sharding_worker.py ep             # 4 virtual devices: ep 2/4, tp 2 x ep 2
"""
from __future__ import annotations

import json
import sys

# Three prompts of 4, 7 and 10 tokens: one prefill step and then decode steps, two
# compiled shapes per configuration (compiles dominate these checks' time).
PROMPTS = [[(7 * i + 3 * j) % 997 + 1 for j in range(4 + 3 * i)] for i in range(3)]
MAX_TOKENS = 6


def tiny_qwen3():
  """A random Qwen3 with 16 query and 8 KV heads (qk-norm on), small enough to compile fast."""
  import jax
  from jaxinfer.config import MODEL_CONFIGS
  from jaxinfer.loading.registry import LoadedModel
  from jaxinfer.model.params import init_params
  cfg = MODEL_CONFIGS["qwen3-0.6b"].replace(
      name="qwen3-tiny-random", vocab_size=1024, hidden_size=128, intermediate_size=256,
      num_layers=2, num_heads=16, num_kv_heads=8, head_dim=16, max_position=512)
  params = init_params(cfg, jax.random.PRNGKey(0), std=0.5)  # well-separated logits
  return LoadedModel(cfg, params, None, "random")


def make_llm(m, mesh, attention="xla", **kw):
  from jaxinfer.buckets import BucketTable
  from jaxinfer.llm import LLM
  return LLM(m, mesh=mesh, num_pages=64, warmup=False, attention=attention, **kw,
             buckets=BucketTable.default(max_tokens=32, max_requests=4, max_pages=2))


def greedy(llm, prompts=PROMPTS):
  from jaxinfer.config import SamplingParams
  sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
  return [o.token_ids for o in llm.generate(prompts, sp)]


def run_tp() -> dict:
  import jax
  from jaxinfer import sharding
  from jaxinfer.step import num_compiled_steps
  m = tiny_qwen3()
  out = {"devices": jax.device_count(), "tokens": {}, "weights": {}, "pool": {}}
  for tp in (1, 2, 4):
    llm = make_llm(m, f"tp:{tp}")
    out["tokens"][f"tp:{tp}"] = greedy(llm)
    if tp == 4:  # warm: the same shapes again (other token values) compile nothing, so
      # every step's outputs (the donated pool included) keep their input's sharding
      before = num_compiled_steps()
      greedy(llm, [[(t * 5 + 11) % 1000 for t in p] for p in PROMPTS])
      out["compiled_when_warm"] = num_compiled_steps() - before
    p = llm.executor.params
    # the layers' matmul weights, in whatever form the executor holds them (one CPU device:
    # packed for the native matmuls where the CPU runs them)
    split = {k: w for k, w in p["layers"].items() if not k.endswith("norm")}
    split["embed"] = p["embed"]
    out["weights"][tp] = {"full": sum(a.nbytes for a in jax.tree_util.tree_leaves(split)),
                          "per_device": sharding.device_bytes(split)}
    pool = llm.executor.pool
    out["pool"][tp] = {"full": sum(a.nbytes for a in pool.values()),
                       "per_device": sharding.device_bytes(pool)}
  out["tokens"]["tp:2 reference"] = greedy(make_llm(m, "tp:2", "reference"))
  # early-exit drafts (the first layer, its own sharded draft step) verified under tp
  spec = make_llm(m, "tp:2", speculative="early_exit", early_exit_layers=1, num_draft=3)
  out["tokens"]["tp:2 early_exit"] = greedy(spec)
  out["spec_rounds"] = sum(r.spec_rounds for r in spec.engine.requests.values())
  for mesh in ("dp:2",):
    llm = make_llm(m, mesh)
    out["tokens"][mesh] = greedy(llm)
    router = llm.engine
    out.setdefault("served", {})[mesh] = [sorted(e.requests) for e in router.replicas]
    out.setdefault("replica_devices", {})[mesh] = [
        sorted(d.id for d in e.executor.devices) for e in router.replicas]
  return out


def tiny_moe(first_dense: int = 0, mla: bool = False):
  """A random mixture of experts (8 experts, top 2) with 4 query and 2 KV heads; mla: a
  DeepSeek-V3-style one (latent attention, sigmoid group-limited router, shared expert),
  its first `first_dense` layers dense."""
  import jax
  from jaxinfer.config import DEEPSEEK_V3, QWEN3_30B_A3B
  from jaxinfer.loading.registry import LoadedModel
  from jaxinfer.model.params import init_params
  common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2,
                num_experts=8, experts_per_token=2, moe_intermediate_size=64, max_position=512)
  if mla:
    cfg = DEEPSEEK_V3.replace(
        name="mla-moe-tiny-random", num_heads=4, num_kv_heads=4, head_dim=32, kv_lora_rank=48,
        qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=0, rope_scaling=(),
        query_scale=None, expert_groups=2, expert_groups_kept=1, shared_expert_size=64,
        first_dense_layers=first_dense, **common)
  else:
    cfg = QWEN3_30B_A3B.replace(name="moe-tiny-random", num_heads=4, num_kv_heads=2,
                                head_dim=16, **common)
  params = init_params(cfg, jax.random.PRNGKey(1), std=0.5)
  return LoadedModel(cfg, params, None, "random")


def run_ep() -> dict:
  """Expert parallel meshes against one device, on a Qwen3-MoE-style model (tp x ep too)
  and a DeepSeek-style one (latent attention: ep without tp; a dense first layer, so its
  layers stay a list), with each device's share of the experts."""
  from jaxinfer import sharding
  out = {"tokens": {}, "experts": {}}
  for name, m, meshes in (("moe", tiny_moe(), ("tp:1", "ep:2", "tp:2,ep:2")),
                          ("mla", tiny_moe(1, mla=True), ("tp:1", "ep:2"))):
    for mesh in meshes:
      llm = make_llm(m, mesh)
      out["tokens"][f"{name} {mesh}"] = greedy(llm)
      layers = llm.executor.params["layers"]
      layers = layers if isinstance(layers, list) else [layers]
      stacks = [lyr["experts_gate"] for lyr in layers if "experts_gate" in lyr]
      stacks = [s for s in stacks if hasattr(s, "addressable_shards")]
      out["experts"][f"{name} {mesh}"] = {
          "full": sum(s.nbytes for s in stacks),
          "per_device": sharding.device_bytes(stacks)}
  return out


def run_dist(port: int, pid: int) -> dict:
  from jaxinfer import sharding
  sharding.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
  import jax
  llm = make_llm(tiny_qwen3(), "tp:2")
  tokens = greedy(llm)
  return {"process": pid, "processes": jax.process_count(),
          "devices": [d.id for d in llm.executor.devices],
          "pool_local_bytes": sharding.device_bytes(llm.executor.pool), "tokens": tokens}


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "tp":
    res = run_tp()
  elif mode == "ep":
    res = run_ep()
  else:
    res = run_dist(int(sys.argv[2]), int(sys.argv[3]))
  print(json.dumps(res))
