"""Several devices: a mesh of `tp` (tensor parallel) x `ep` (expert parallel) x `dp`
(data parallel) devices.

Tensor parallelism (Megatron layout, one rule table): weights are placed by the logical
axes each `model.params.WeightSpec` declares, mapped to mesh axes by `RULES` through
flax's logical partitioning (`flax.linen.logical_to_mesh_sharding`):
  q_heads, kv_heads -> tp   wq / wk / wv split by columns (heads), wo by rows
  mlp               -> tp   w_gate / w_up split by columns, w_down by rows
  vocab             -> tp   the embedding and LM head split by vocabulary
  everything else   -> replicated (norms, the layer axis, the model dimension)
So each layer runs its attention and FFN on 1/tp of the heads and columns, and XLA's
SPMD partitioner adds the two all-reduces of [T, D] per layer (after wo and w_down),
the communication 8.1's cost model charges (`costmodel.formulas.tp_comm_bytes`).
The KV pool is split by KV heads (axis 1 of every pool component); attention and the
pool write run per shard through `shard_map`, so no device ever reads another's pages.
Sampling reads logits split by vocabulary; XLA gathers what the sort / argmax needs, so
the tokens are those of one device.

tp must divide the query heads, the KV heads and the FFN width (SmolLM2: 9 query and 3
KV heads, so tp 1 or 3; Qwen3-8B: 32 / 8, so tp 1, 2, 4 or 8); other values are refused
with the reason. The vocabulary is split when tp divides it and replicated otherwise.

Expert parallelism (a mixture of experts): a replica's mesh is ep x tp; `experts` -> ep
splits each expert stack's experts over the ep groups (their FFN width over tp inside a
group). Activations stay replicated, so each device runs the rows routed to its experts
and one all-reduce over the mesh sums them (model/moe.py, under `shard_map`).

Data parallelism: `dp` replicas on disjoint groups of tp x ep devices, each with its own
pool and scheduler, behind one router (`runtime.router.Router`).

Several processes: `initialize_distributed` joins a `jax.distributed` job; the mesh then
spans every process's devices and each process runs the same engine loop (SPMD).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig

log = logging.getLogger(__name__)

TP = "tp"
EP = "ep"
# logical axis (model.params.WeightSpec.axes) -> mesh axis; None: replicated
RULES = (("q_heads", TP), ("kv_heads", TP), ("mlp", TP), ("vocab", TP),
         ("embed", None), ("layers", None), ("head_dim", None), ("experts", EP),
         ("expert_scores", None), ("kv_lora", None), ("q_lora", None))


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """`tp:N[,ep:E][,dp:M]` (the CLI's --mesh, LLM(mesh=...)): N x E devices per replica
  (tensor parallel N, expert parallel E), M replicas."""
  tp: int = 1
  dp: int = 1
  ep: int = 1

  @classmethod
  def parse(cls, text) -> "MeshSpec":
    if isinstance(text, MeshSpec):
      return text
    if text is None or text == "":
      return cls()
    if not isinstance(text, str):
      raise ValueError(f"mesh must be a string like 'tp:2,dp:2', got {text!r}")
    sizes = {}
    for part in text.split(","):
      m = re.fullmatch(r"\s*(tp|dp|ep)\s*:\s*(\d+)\s*", part)
      if not m:
        raise ValueError(f"mesh: {part!r} in {text!r} is not 'tp:N', 'ep:E' or 'dp:M' "
                         f"(N, E, M >= 1)")
      if m.group(1) in sizes:
        raise ValueError(f"mesh: {m.group(1)} given twice in {text!r}")
      sizes[m.group(1)] = int(m.group(2))
    spec = cls(**sizes)
    if spec.tp < 1 or spec.dp < 1 or spec.ep < 1:
      raise ValueError(f"mesh: tp, ep and dp must be >= 1, got {text!r}")
    return spec

  @property
  def replica_devices(self) -> int:
    return self.tp * self.ep

  @property
  def devices(self) -> int:
    return self.replica_devices * self.dp

  def __str__(self):
    return f"tp:{self.tp},ep:{self.ep},dp:{self.dp}" if self.ep > 1 else \
        f"tp:{self.tp},dp:{self.dp}"


def check_single_device_features(tp: int, other_device: bool, offload=None,
                                 lora: bool = False) -> None:
  """Raise for what runs on the first device only: weight offload (it streams to that
  device) with tp > 1 or on another device, LoRA slots with tp > 1. Checked by the LLM
  before the model loads (other_device: dp > 1) and by each executor for itself."""
  if offload is not None and offload.layers and (tp > 1 or other_device):
    where = f"tp={tp}" if tp > 1 else "a data-parallel replica on another device"
    raise ValueError(f"weight offload streams to the first device only: not with {where}")
  if lora and tp > 1:
    raise ValueError(f"LoRA adapters run on one device: not with tp={tp}")


def device_groups(spec: MeshSpec, devices: Optional[Sequence] = None):
  """dp groups of tp devices each (disjoint), from `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  if spec.devices > len(devices):
    raise ValueError(f"mesh {spec} needs {spec.devices} devices, {len(devices)} are visible "
                     f"({jax.default_backend()}); on CPU set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={spec.devices}")
  n = spec.replica_devices
  return [devices[i * n:(i + 1) * n] for i in range(spec.dp)]


def tp_mesh(devices: Sequence, ep: int = 1) -> Mesh:
  """One replica's mesh: ep x tp devices (expert parallel over the first axis)."""
  devices = list(devices)
  return Mesh(np.array(devices).reshape(ep, len(devices) // ep), (EP, TP))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """The static sharding of one replica's step (hashable: part of jit's static key): tp
  devices split heads and FFN columns; ep groups of them split the experts."""
  mesh: Mesh
  split_vocab: bool

  @property
  def size(self) -> int:
    return self.mesh.shape[TP]

  @property
  def ep(self) -> int:
    return self.mesh.shape[EP]

  def rules(self):
    return tuple((a, None if (a == "vocab" and not self.split_vocab) else m) for a, m in RULES)

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def pool_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(None, TP))  # every pool component: [L, K, ...]


def make_tp(cfg: ModelConfig, devices: Sequence, ep: int = 1) -> TensorParallel:
  tp = len(devices) // ep
  cfg.check_tp(tp)
  cfg.check_ep(ep)
  split_vocab = cfg.vocab_size % tp == 0
  if not split_vocab:
    log.info("vocab %d is not divisible by tp=%d: the embedding and LM head are replicated",
             cfg.vocab_size, tp)
  return TensorParallel(tp_mesh(devices, ep), split_vocab)


def param_shardings(cfg: ModelConfig, tp: TensorParallel, params):
  """NamedSharding per weight, from the WeightSpec axes through the rule table."""
  import flax.linen as nn
  from jaxinfer.model.params import WeightSpec, layer_specs, weight_specs
  specs = weight_specs(cfg)
  if isinstance(params["layers"], (list, tuple)):  # unrolled: per-layer dicts
    specs = dict(specs, layers=[layer_specs(cfg, i) for i in range(len(params["layers"]))])
  axes = jax.tree_util.tree_map(lambda s: P(*s.axes), specs,
                                is_leaf=lambda x: isinstance(x, WeightSpec))
  return nn.logical_to_mesh_sharding(axes, tp.mesh, tp.rules())


def _put(x, sharding: NamedSharding):
  """Place a host or device array with `sharding`; works when the mesh spans processes."""
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(params, cfg: ModelConfig, tp: TensorParallel):
  return jax.tree_util.tree_map(_put, params, param_shardings(cfg, tp, params))


def device_bytes(tree) -> dict:
  """Bytes each device holds of a pytree of arrays (from the arrays' own shards)."""
  out = {}
  for a in jax.tree_util.tree_leaves(tree):
    for s in a.addressable_shards:
      out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
  return out


def initialize_distributed(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
  """Join a multi-process job (jax.distributed) before any other JAX call. Arguments
  default to JAXINFER_COORDINATOR / JAXINFER_NUM_PROCESSES / JAXINFER_PROCESS_ID; on CPU
  the collectives run over gloo. Returns False (nothing done) when no coordinator is set.
  On GPU clusters the same three values come from the launcher (one process per host,
  each seeing its local GPUs); the mesh then spans every process's devices."""
  coordinator = coordinator or os.environ.get("JAXINFER_COORDINATOR") or None
  if not coordinator:
    return False
  n = num_processes if num_processes is not None else os.environ.get("JAXINFER_NUM_PROCESSES")
  i = process_id if process_id is not None else os.environ.get("JAXINFER_PROCESS_ID")
  try:
    n, i = int(n), int(i)
  except (TypeError, ValueError):
    raise ValueError(f"distributed: num_processes and process_id must be integers, got "
                     f"{n!r} and {i!r}") from None
  if n < 1:
    raise ValueError(f"distributed: num_processes must be >= 1, got {n}")
  if not 0 <= i < n:
    raise ValueError(f"distributed: process_id must be in [0, {n}), got {i} "
                     f"(num_processes={n})")
  if not re.fullmatch(r"[^:\s]+:\d+", coordinator):
    raise ValueError(f"distributed: coordinator must be HOST:PORT, got {coordinator!r}")
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, n, i)
  log.info("process %d of %d joined %s: %d devices (%d local)", i, n, coordinator,
           jax.device_count(), jax.local_device_count())
  return True
