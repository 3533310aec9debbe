"""The mixture-of-experts MLP: a router picks k of E experts per token, each token runs
through its k expert MLPs only, and their outputs are summed with the router's weights.

Dropless: every (token, expert) assignment is computed, whatever the routing (no capacity
factor). The assignments are sorted by expert so each expert's rows are contiguous, then
the experts' products run grouped:
  - on GPU / TPU as `jax.lax.ragged_dot` over the sorted rows (one grouped matmul);
  - on CPU, where XLA lowers ragged_dot to every expert over every row (measured:
    docs/design.md), as a loop over slabs of sorted rows, each slab holding one
    expert's rows (each expert's group padded to whole slabs), so a step reads only the
    experts its tokens reach and computes at most one partial slab per expert extra.
Letters: T tokens, D model dim, E experts, k experts per token, F an expert's width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.linear import Experts, linear

EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")

_observer = None  # a host callable given each MoE layer call's rows per expert


def observe_routing(fn) -> None:
  """Have every MoE layer traced from now on report, on the host, its rows per expert
  (an int32 array [E], a bucket's padding rows not counted) to fn at each call: a measured
  routing histogram for a study. None: stop. Executables traced before keep what they
  were traced with."""
  global _observer
  _observer = fn


def in_place(layer: dict) -> dict:
  """A stacked layer dict with its expert matrices wrapped in `Experts` (read in place)."""
  return {k: Experts(w) if k in EXPERT_WEIGHTS and not isinstance(w, Experts) else w
          for k, w in layer.items()}


def _expert(w, e):
  return w.expert(e) if isinstance(w, Experts) else w[e]


def _stacked(w):
  return w.stacked() if isinstance(w, Experts) else w


def route(logits, cfg: ModelConfig, bias=None):
  """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int32).

  softmax: the top k of softmax over all experts, renormalised to sum to 1 where the
  family does (Mixtral, Qwen3-MoE's norm_topk_prob). sigmoid (DeepSeek-V3): sigmoid
  scores; the choice adds the selection `bias` and keeps only the expert_groups_kept best
  groups (a group's score: the sum of its two best biased scores); the weights are the
  unbiased scores of the chosen experts, renormalised where configured, times
  routed_scaling.
  """
  k = cfg.experts_per_token
  logits = logits.astype(jnp.float32)
  if cfg.router == "softmax":
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
  else:
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    g = cfg.expert_groups
    if g > 1:
      T, E = choice.shape
      grouped = choice.reshape(T, g, E // g)
      group_score = jax.lax.top_k(grouped, min(2, E // g))[0].sum(-1)  # [T, g]
      _, kept = jax.lax.top_k(group_score, cfg.expert_groups_kept)
      keep = jnp.zeros((T, g), bool).at[jnp.arange(T)[:, None], kept].set(True)
      choice = jnp.where(jnp.repeat(keep, E // g, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.norm_topk_prob and k > 1:
    weights = weights / (weights.sum(-1, keepdims=True) + (
        1e-20 if cfg.router == "sigmoid" else 0.0))
  return weights * cfg.routed_scaling, experts.astype(jnp.int32)


def slab_rows(assignments: int, num_experts: int) -> int:
  """Rows per slab of the CPU loop (static): about the rows an expert gets under even
  routing, as a power of two in [8, 64] (small enough that padding each touched expert to
  whole slabs stays cheap, large enough that an expert's weights are read once per slab
  of many rows)."""
  per_expert = max(1, -(-assignments // num_experts))
  return min(64, max(8, 1 << (per_expert - 1).bit_length()))


def _expert_mlp(x, wg, wu, wd, act):
  """x [M, D] through one expert's (or a group's, by ragged products) gated MLP."""
  h = act(jnp.einsum("md,df->mf", x, wg.astype(x.dtype), preferred_element_type=jnp.float32))
  u = jnp.einsum("md,df->mf", x, wu.astype(x.dtype), preferred_element_type=jnp.float32)
  return jnp.einsum("mf,fd->md", (h * u).astype(x.dtype), wd.astype(x.dtype),
                    preferred_element_type=jnp.float32)


def grouped_experts(x_sorted, expert_sorted, sizes, wg, wu, wd, act, *, ragged: bool):
  """The gated MLP of each sorted row's expert: x_sorted [A, D] (rows sorted by expert),
  expert_sorted [A], sizes [E] rows per expert; wg, wu [E, D, F], wd [E, F, D] (arrays, or
  `Experts` read in place). Rows past
  sum(sizes) (expert E: no expert) come out zero. Returns [A, D] float32."""
  if ragged:
    dt = x_sorted.dtype
    rd = lambda a, w: jax.lax.ragged_dot(a, _stacked(w).astype(dt), sizes,  # noqa: E731
                                         preferred_element_type=jnp.float32)
    h = (act(rd(x_sorted, wg)) * rd(x_sorted, wu)).astype(dt)
    return rd(h, wd)
  A, D = x_sorted.shape
  E = sizes.shape[0]
  b = slab_rows(A, E)
  slabs = (A + min(E, A) * (b - 1)) // b  # bound: each touched expert pads < one slab
  padded = -(-sizes // b) * b  # [E] each expert's rows rounded up to whole slabs
  start = jnp.cumsum(padded) - padded  # first padded row of each expert
  first = jnp.cumsum(sizes) - sizes  # first sorted row of each expert
  # rows of no expert (index E) land past the slabs: dropped, and read back as zeros
  start_x = jnp.append(start, slabs * b)
  first_x = jnp.append(first, 0)
  row = start_x[expert_sorted] + jnp.arange(A) - first_x[expert_sorted]  # padded row
  xp = jnp.zeros((slabs * b, D), x_sorted.dtype).at[row].set(x_sorted, mode="drop")
  # the expert of each slab: the last expert starting at or before it; slabs past the
  # last used one stay zero rows and are skipped
  used = jnp.sum(padded) // b
  owner = jnp.searchsorted(start // b, jnp.arange(slabs), side="right") - 1
  owner = jnp.clip(owner, 0, E - 1).astype(jnp.int32)

  def one(j):
    def run(_):
      xb = jax.lax.dynamic_slice_in_dim(xp, j * b, b)
      e = owner[j]
      return _expert_mlp(xb, _expert(wg, e), _expert(wu, e), _expert(wd, e), act)

    return jax.lax.cond(j < used, run, lambda _: jnp.zeros((b, D), jnp.float32), None)

  yp = jax.lax.map(one, jnp.arange(slabs)).reshape(slabs * b, D)
  return yp.at[row].get(mode="fill", fill_value=0)


def _routed(x, weights, experts, wg, wu, wd, act, num_experts: int):
  """Each row of x [T, D] through its k experts (experts [T, k], index num_experts: none),
  summed with weights [T, k]: [T, D] float32."""
  T, D = x.shape
  k = experts.shape[1]
  flat = experts.reshape(-1)  # [T k]
  order = jnp.argsort(flat, stable=True)
  token = order // k
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  y = grouped_experts(x[token], flat[order], sizes, wg, wu, wd, act,
                      ragged=jax.default_backend() != "cpu")
  y = y * weights.reshape(-1)[order][:, None]
  return jnp.zeros((T, D), jnp.float32).at[token].add(y)


def _spec(w, f_axis: int):
  """The partition of an expert stack [(L,) E, in, out]: experts over ep, the FFN width
  (axis f_axis of one expert's matrix) over tp."""
  from jax.sharding import PartitionSpec as P
  from jaxinfer.sharding import EP, TP
  per = [EP, None, None]
  per[1 + f_axis] = TP
  if isinstance(w, Experts):
    return Experts(P(None, *per), P())
  return P(*per)


def _routed_parallel(x, weights, experts, wg, wu, wd, act, num_experts: int, par):
  """_routed over a replica's mesh: each ep group holds num_experts / ep experts (and each
  tp device a 1/tp slice of their FFN width); every device takes the rows routed to its
  experts (tokens are replicated: no exchange before the experts) and the partial sums
  meet in one all-reduce over the mesh."""
  from jax.sharding import PartitionSpec as P
  from jaxinfer.sharding import EP, TP
  local_experts = num_experts // par.ep

  def local(x, weights, experts, wg, wu, wd):
    first = jax.lax.axis_index(EP) * local_experts
    mine = experts - first
    mine = jnp.where((mine >= 0) & (mine < local_experts), mine, local_experts)
    return jax.lax.psum(_routed(x, weights, mine, wg, wu, wd, act, local_experts), (EP, TP))

  return jax.shard_map(
      local, mesh=par.mesh,
      in_specs=(P(), P(), P(), _spec(wg, 1), _spec(wu, 1), _spec(wd, 0)),
      out_specs=P(), check_vma=False)(x, weights, experts, wg, wu, wd)


def moe_mlp(x, p, cfg: ModelConfig, act, real=None, par=None):
  """x [T, D] (normed) -> [T, D]: routed experts (weighted sum) plus the shared expert.
  real [T] bool: the rows that are tokens (a bucket's padding rows reach no expert, so a
  padded step reads no more experts than its tokens need); None: every row.
  par: the replica's sharding.TensorParallel when it spans several devices (experts over
  its ep axis, their FFN width over tp); None: one device."""
  with jax.named_scope("router"):
    logits = linear(x, p["router"])
    weights, experts = route(logits, cfg, p.get("router_bias"))
  with jax.named_scope("experts"):
    if real is not None:  # padding rows: expert E, sorted last, in no group
      experts = jnp.where(real[:, None], experts, cfg.num_experts)
    if _observer is not None:
      jax.debug.callback(_observer, jnp.bincount(experts.reshape(-1), length=cfg.num_experts))
    args = (x, weights, experts, p["experts_gate"], p["experts_up"], p["experts_down"], act,
            cfg.num_experts)
    out = _routed(*args) if par is None else _routed_parallel(*args, par)
  if cfg.shared_expert_size:
    with jax.named_scope("shared_expert"):
      h = act(linear(x, p["shared_gate"]).astype(jnp.float32)) * linear(
          x, p["shared_up"]).astype(jnp.float32)
      out = out + linear(h.astype(x.dtype), p["shared_down"]).astype(jnp.float32)
  return out.astype(x.dtype)
