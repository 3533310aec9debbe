"""Frozen configuration dataclasses: model architecture, engine and sampling.

Model dimensions follow the published configs of each model family. Everything here
is hashable so a config can be a static argument of a jitted function.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Optional, Tuple


FAMILIES = ("llama", "qwen3", "qwen2", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe",
            "mixtral", "deepseek_v3")
ROPE_SCALINGS = {"linear": 2, "llama3": 5, "yarn": 7}  # kind -> entries of its tuple
ACTIVATIONS = ("silu", "gelu_tanh")
ROUTERS = ("softmax", "sigmoid")  # how a mixture of experts scores its experts


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. The families differ only in the fields after
  `qk_norm`, which the model reads at trace time (one transformer for all of them)."""
  name: str
  family: str  # one of FAMILIES (the loaders' names; the fields below carry the math)
  vocab_size: int
  hidden_size: int  # D
  intermediate_size: int  # F
  num_layers: int
  num_heads: int  # N (query heads)
  num_kv_heads: int  # K
  head_dim: int  # H
  rope_theta: float
  rms_norm_eps: float
  tie_embeddings: bool
  max_position: int
  qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm on q and k
  bos_token_id: Optional[int] = None
  eos_token_ids: Tuple[int, ...] = ()
  qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
  hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh (Gemma)
  norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + w)
  embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
  sandwich_norms: bool = False  # Gemma 2/3: RMSNorm after the attention and MLP outputs too
  query_scale: Optional[float] = None  # attention scores' scale (None: head_dim ** -0.5)
  attn_softcap: Optional[float] = None  # Gemma 2: scores capped at +-cap (cap * tanh(s/cap))
  final_softcap: Optional[float] = None  # Gemma 2: logits capped the same way
  layer_windows: Tuple[int, ...] = ()  # sliding window per layer (0: full); (): all full
  rope_local_theta: Optional[float] = None  # Gemma 3: the RoPE base of windowed layers
  rope_scaling: Tuple = ()  # ("linear", factor) | ("llama3", factor, low_freq_factor,
  #                            high_freq_factor, original_max_position) | ("yarn", factor,
  #                            original_max_position, beta_fast, beta_slow,
  #                            attention_factor, truncate)
  partial_rotary: float = 1.0  # share of each head's dims RoPE rotates (the first ones)
  # --- mixture of experts (num_experts 0: every layer has the dense MLP) ------------------
  num_experts: int = 0  # E routed experts per MoE layer
  experts_per_token: int = 0  # k: the experts each token is routed to
  moe_intermediate_size: int = 0  # each expert's FFN width
  router: str = "softmax"  # softmax over all experts (Qwen3-MoE, Mixtral) | sigmoid scores
  #                          with a selection bias and group-limited choice (DeepSeek-V3)
  norm_topk_prob: bool = True  # the k weights renormalised to sum to 1
  routed_scaling: float = 1.0  # the routed experts' sum scaled (DeepSeek-V3: 2.5)
  expert_groups: int = 1  # sigmoid router: experts in this many groups; a token picks from
  expert_groups_kept: int = 1  # the best groups only (by the sum of each group's top 2)
  shared_expert_size: int = 0  # FFN width of an always-on shared expert MLP (0: none)
  first_dense_layers: int = 0  # the first layers keep the dense MLP (DeepSeek-V3: 3)
  # --- multi-head latent attention (kv_lora_rank 0: standard attention) ---------------
  # head_dim is then each query / key head's width (its no-RoPE part plus its RoPE part)
  kv_lora_rank: int = 0  # r: the compressed latent each token stores per layer
  qk_rope_head_dim: int = 0  # each head's decoupled RoPE dims (one RoPE key per token)
  v_head_dim: int = 0  # each head's value width
  q_lora_rank: int = 0  # queries through a low-rank latent of this width (0: direct)

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"unknown model family {self.family!r}; supported: {FAMILIES}")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
    if self.layer_windows and len(self.layer_windows) != self.num_layers:
      raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for "
                       f"{self.num_layers} layers")
    if any(w < 0 for w in self.layer_windows):
      raise ValueError(f"layer_windows must be >= 0 (0: full attention), got "
                       f"{self.layer_windows}")
    if self.rope_scaling and (self.rope_scaling[0] not in ROPE_SCALINGS or len(
        self.rope_scaling) != ROPE_SCALINGS[self.rope_scaling[0]]):
      raise ValueError(f"rope_scaling must be ('linear', factor), ('llama3', factor, low, "
                       f"high, original_max_position) or ('yarn', factor, "
                       f"original_max_position, beta_fast, beta_slow, attention_factor, "
                       f"truncate), got {self.rope_scaling!r}")
    if not 0 < self.partial_rotary <= 1 or self.rotary_dim % 2:
      raise ValueError(f"partial_rotary must be in (0, 1] and rotate an even number of "
                       f"dims, got {self.partial_rotary} of head_dim {self.head_dim}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.num_experts:
      if self.router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
      if not 1 <= self.experts_per_token <= self.num_experts:
        raise ValueError(f"experts_per_token must be in [1, num_experts={self.num_experts}]"
                         f", got {self.experts_per_token}")
      if self.moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size must be >= 1 with num_experts="
                         f"{self.num_experts}, got {self.moe_intermediate_size}")
      g, kept = self.expert_groups, self.expert_groups_kept
      if g < 1 or self.num_experts % g or not 1 <= kept <= g:
        raise ValueError(f"expert_groups={g} must divide num_experts={self.num_experts} and "
                         f"expert_groups_kept={kept} must be in [1, {g}]")
      if kept * (self.num_experts // g) < self.experts_per_token:
        raise ValueError(f"expert_groups_kept={kept} groups of {self.num_experts // g} "
                         f"experts hold fewer than experts_per_token="
                         f"{self.experts_per_token}")
      if not 0 <= self.first_dense_layers <= self.num_layers:
        raise ValueError(f"first_dense_layers must be in [0, {self.num_layers}], got "
                         f"{self.first_dense_layers}")
    if self.kv_lora_rank and not (0 < self.qk_rope_head_dim < self.head_dim
                                  and self.v_head_dim > 0):
      raise ValueError(f"latent attention (kv_lora_rank={self.kv_lora_rank}) needs 0 < "
                       f"qk_rope_head_dim < head_dim={self.head_dim} and v_head_dim > 0, got "
                       f"{self.qk_rope_head_dim} and {self.v_head_dim}")

  def check_tp(self, tp: int) -> None:
    """Raise unless tensor parallelism over `tp` devices splits the query heads, the KV
    heads and the FFN width evenly (jaxinfer/sharding.py, costmodel's tp model)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
      raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if self.mla and tp > 1:
      raise ValueError(f"tp={tp}: {self.name}'s latent attention stores one latent per token "
                       "(no KV heads to split); run it with tp=1")
    sizes = (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
             ("intermediate_size", self.intermediate_size))
    for name, n in sizes:
      if n % tp:
        ok = [t for t in range(1, self.num_kv_heads + 1) if not any(v % t for _, v in sizes)]
        raise ValueError(
            f"tp={tp} does not divide {self.name}'s {name}={n}: each device would hold a "
            f"fraction of a head or FFN column block; tp must divide num_heads="
            f"{self.num_heads}, num_kv_heads={self.num_kv_heads} and intermediate_size="
            f"{self.intermediate_size} (possible: {ok})")

  def check_ep(self, ep: int) -> None:
    """Raise unless expert parallelism over `ep` device groups splits the experts evenly."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
      raise ValueError(f"ep must be an integer >= 1, got {ep!r}")
    if ep > 1 and (not self.num_experts or self.num_experts % ep):
      raise ValueError(f"ep={ep} needs a mixture of experts whose num_experts it divides; "
                       f"{self.name} has num_experts={self.num_experts}")

  @property
  def q_per_kv(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def mla(self) -> bool:
    """Multi-head latent attention (DeepSeek): the pool holds one latent per token."""
    return self.kv_lora_rank > 0

  @property
  def cache_heads(self) -> int:
    """KV heads the pool stores per token and layer: MLA's latent is one."""
    return 1 if self.mla else self.num_kv_heads

  @property
  def cache_dim(self) -> int:
    """Width of each stored head: MLA's latent plus its RoPE key (values are the latent's
    first kv_lora_rank dims, not stored again); else head_dim."""
    return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else self.head_dim

  @property
  def rotary_dim(self) -> int:
    """The dims of each head RoPE rotates (the first ones; the rest pass through; MLA:
    its decoupled RoPE part)."""
    if self.mla:
      return self.qk_rope_head_dim
    return int(self.head_dim * self.partial_rotary)

  @property
  def windows(self) -> Tuple[int, ...]:
    """Each layer's sliding window (0: full attention)."""
    return self.layer_windows or (0,) * self.num_layers

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  # --- sizes derived from the config (8.1, 8.2.1); never typed in -------------------
  @property
  def moe_layers(self) -> int:
    """Layers whose MLP is a mixture of experts (the rest keep the dense MLP)."""
    return self.num_layers - self.first_dense_layers if self.num_experts else 0

  def attention_param_count(self) -> int:
    """One layer's attention projections (with biases) and its norms."""
    d, n, k, h = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
    norms = (4 if self.sandwich_norms else 2) * d + (2 * h if self.qk_norm else 0)
    if self.mla:  # q (direct or through its latent), the KV latent and RoPE key, the
      # latent's up-projection to each head's no-RoPE key and value, the output
      r, qr, dr, dv = self.kv_lora_rank, self.q_lora_rank, self.qk_rope_head_dim, \
          self.v_head_dim
      q = d * qr + qr + qr * n * h if qr else d * n * h
      return q + d * (r + dr) + r + r * n * (h - dr + dv) + n * dv * d + norms
    attn = d * n * h + 2 * d * k * h + n * h * d + ((n + 2 * k) * h if self.qkv_bias else 0)
    return attn + norms

  def expert_param_count(self) -> int:
    """One routed expert's gate, up and down matrices."""
    return 3 * self.hidden_size * self.moe_intermediate_size

  def moe_mlp_param_count(self, experts: Optional[float] = None) -> float:
    """One MoE layer's MLP holding `experts` routed experts (default all of them): the
    router (and a sigmoid router's selection bias), the shared expert, the experts."""
    e = self.num_experts if experts is None else experts
    router = self.hidden_size * self.num_experts + (
        self.num_experts if self.router == "sigmoid" else 0)
    return router + 3 * self.hidden_size * self.shared_expert_size + e * \
        self.expert_param_count()

  def layer_param_count(self) -> int:
    """One dense layer's parameters (attention, norms, the dense MLP)."""
    return self.attention_param_count() + 3 * self.hidden_size * self.intermediate_size

  def layers_param_count(self, experts: Optional[float] = None) -> int:
    """All layers' parameters, each MoE layer holding `experts` routed experts (default:
    all; experts_per_token: the parameters one token's product runs through)."""
    dense = self.num_layers - self.moe_layers
    return int(dense * self.layer_param_count() + self.moe_layers * (
        self.attention_param_count() + self.moe_mlp_param_count(experts)))

  def param_count(self) -> int:
    emb = self.vocab_size * self.hidden_size
    head = 0 if self.tie_embeddings else emb
    return emb + head + self.layers_param_count() + self.hidden_size

  def active_param_count(self) -> int:
    """Parameters one token's product runs through (its routed experts only; 8.4.1's
    active parameters, the embedding table counted once as in the published figures)."""
    emb = self.vocab_size * self.hidden_size
    head = 0 if self.tie_embeddings else emb
    return emb + head + self.layers_param_count(self.experts_per_token) + self.hidden_size

  def weight_bytes(self, bytes_per_param: float = 2.0) -> int:
    """Total stored weight bytes (the chapter's reference data: Qwen3-8B bf16 = 16,381,470,720)."""
    return int(self.param_count() * bytes_per_param)

  def expected_experts_touched(self, tokens: float, load=None) -> float:
    """Routed experts of one MoE layer that `tokens` tokens reach, expected: each token
    picks k of E, reaching expert e with probability k p_e (p_e: e's share of all
    assignments, `load`; default uniform, 1/E), so e escapes `tokens` independent tokens
    with probability (1 - k p_e)^tokens."""
    if not self.num_experts:
      return 0.0
    e, k = self.num_experts, self.experts_per_token
    if load is None:
      return e * (1.0 - (1.0 - k / e) ** max(tokens, 0))
    return float(sum(1.0 - (1.0 - min(1.0, k * p)) ** max(tokens, 0) for p in load))

  def weight_bytes_read_per_step(self, bytes_per_param: float = 2.0,
                                 tokens: Optional[float] = None, load=None) -> int:
    """D_w (8.2.1): matrix weights one step reads; the embedding table is only looked up.

    With tied embeddings the table doubles as the LM head and is read whole. A mixture of
    experts reads only the experts the step's `tokens` reach (expected under uniform
    routing, or under a measured `load`: expected_experts_touched; tokens None: all of
    them, the bound a large batch approaches).
    """
    emb = self.vocab_size * self.hidden_size
    experts = None if tokens is None else self.expected_experts_touched(tokens, load)
    read = emb + self.layers_param_count(experts) + self.hidden_size  # head or tied table
    return int(read * bytes_per_param)

  def flops_per_token(self) -> int:
    """Matmul FLOPs per token, excluding attention over context (2 per MAC)."""
    return 2 * (self.layers_param_count(self.experts_per_token)
                + self.vocab_size * self.hidden_size)

  def attention_flops_per_pair(self) -> int:
    """FLOPs per causal (query, key) pair summed over layers: QK^T and PV (MLA: with the
    up-projections absorbed, both over the latent, as its decode runs)."""
    if self.mla:
      return 2 * self.num_layers * self.num_heads * (2 * self.kv_lora_rank
                                                     + self.qk_rope_head_dim)
    return 4 * self.num_layers * self.num_heads * self.head_dim


SMOLLM2_135M = ModelConfig(
    name="smollm2-135m-instruct", family="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True, max_position=8192,
    bos_token_id=1, eos_token_ids=(2,))

QWEN3_0_6B = ModelConfig(
    name="qwen3-0.6b", family="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=True, max_position=40960,
    qk_norm=True, bos_token_id=151643, eos_token_ids=(151645, 151643))

QWEN3_8B = ModelConfig(
    name="qwen3-8b", family="qwen3", vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=False, max_position=40960,
    qk_norm=True, bos_token_id=151643, eos_token_ids=(151645, 151643))

# Sliding-window models for the cost model and planner (shapes from their published HF
# config.json files: mistralai/Mistral-7B-v0.1, google/gemma-2-9b).
MISTRAL_7B = ModelConfig(
    name="mistral-7b", family="mistral", vocab_size=32000, hidden_size=4096,
    intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
    rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=False, max_position=32768,
    bos_token_id=1, eos_token_ids=(2,), layer_windows=(4096,) * 32)

GEMMA2_9B = ModelConfig(
    name="gemma-2-9b", family="gemma2", vocab_size=256000, hidden_size=3584,
    intermediate_size=14336, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=True, max_position=8192,
    bos_token_id=2, eos_token_ids=(1, 107), hidden_act="gelu_tanh", norm_offset=1.0,
    embed_scale=True, sandwich_norms=True, query_scale=256 ** -0.5, attn_softcap=50.0,
    final_softcap=30.0, layer_windows=tuple(4096 if i % 2 == 0 else 0 for i in range(42)))

# Mixtures of experts and latent attention for the cost model and planner (shapes from the
# published HF config.json files: Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B,
# mistralai/Mixtral-8x7B-v0.1, deepseek-ai/DeepSeek-V3; DeepSeek-V3's multi-token-prediction
# layer is not counted).
QWEN3_30B_A3B = ModelConfig(
    name="qwen3-30b-a3b", family="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=False, max_position=40960,
    qk_norm=True, bos_token_id=151643, eos_token_ids=(151645, 151643), num_experts=128,
    experts_per_token=8, moe_intermediate_size=768, norm_topk_prob=True)

QWEN3_235B_A22B = QWEN3_30B_A3B.replace(
    name="qwen3-235b-a22b", hidden_size=4096, intermediate_size=12288, num_layers=94,
    num_heads=64, moe_intermediate_size=1536)

MIXTRAL_8X7B = ModelConfig(
    name="mixtral-8x7b", family="mixtral", vocab_size=32000, hidden_size=4096,
    intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
    rope_theta=1000000.0, rms_norm_eps=1e-5, tie_embeddings=False, max_position=32768,
    bos_token_id=1, eos_token_ids=(2,), num_experts=8, experts_per_token=2,
    moe_intermediate_size=14336)

DEEPSEEK_V3 = ModelConfig(
    name="deepseek-v3", family="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=False, max_position=163840,
    bos_token_id=0, eos_token_ids=(1,), num_experts=256, experts_per_token=8,
    moe_intermediate_size=2048, router="sigmoid", routed_scaling=2.5, expert_groups=8,
    expert_groups_kept=4, shared_expert_size=2048, first_dense_layers=3, kv_lora_rank=512,
    qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536,
    rope_scaling=("yarn", 40.0, 4096.0, 32.0, 1.0, 1.0, True),
    query_scale=192 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2)  # YaRN's mscale, squared

MODEL_CONFIGS = {c.name: c for c in (SMOLLM2_135M, QWEN3_0_6B, QWEN3_8B, MISTRAL_7B,
                                     GEMMA2_9B, QWEN3_30B_A3B, QWEN3_235B_A22B,
                                     MIXTRAL_8X7B, DEEPSEEK_V3)}


def get_model_config(name: str) -> ModelConfig:
  try:
    return MODEL_CONFIGS[name]
  except KeyError:
    raise ValueError(
        f"unknown model {name!r}; known models: {sorted(MODEL_CONFIGS)}") from None


INT32_MAX = 2**31 - 1  # token ids, top_k and lengths travel to the device as int32


def _check_int(name: str, v, lo: int, hi: int) -> None:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral):
    raise ValueError(f"{name} must be an integer, got {v!r}")
  if not lo <= v <= hi:
    raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


def _check_real(name: str, v, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
  if isinstance(v, bool) or not isinstance(v, numbers.Real):
    raise ValueError(f"{name} must be a number, got {v!r}")
  if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
    lo_b = "(" if lo_open else "["
    raise ValueError(f"{name} must be a finite number in {lo_b}{lo}, {hi}], got {v}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling parameters (travel to the device as arrays)."""
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0
  seed: Optional[int] = None
  max_tokens: int = 64
  stop_token_ids: Tuple[int, ...] = ()
  stop: Tuple[str, ...] = ()  # stop strings
  ignore_eos: bool = False
  # Structured output (jaxinfer/structured), at most one: the text must match.
  json_schema: Optional[str] = None  # a JSON Schema (dict, or its JSON text; kept as text)
  json_object: bool = False  # any JSON object
  regex: Optional[str] = None
  grammar: Optional[str] = None  # a context-free grammar: Lark or llama.cpp GBNF text
  choice: Optional[Tuple[str, ...]] = None  # exactly one of these strings
  # Logits processing (vLLM's names and ranges); a step carries this work only when one
  # of its requests uses it.
  min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
  presence_penalty: float = 0.0  # -p for every token already in the output
  frequency_penalty: float = 0.0  # -f x count of the token in the output
  repetition_penalty: float = 1.0  # over prompt and output: logit / r if > 0, else x r
  min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many
  logit_bias: Optional[Tuple[Tuple[int, float], ...]] = None  # {token id: bias in [-100, 100]}
  logprobs: Optional[int] = None  # top-N alternatives per output token (0..20)
  lora: Optional[str] = None  # the name of a registered LoRA adapter (8.2.1); None = base

  def __post_init__(self):
    """Every field checked for type and range before anything uses it; the error names
    the field, the value and the limit. Seeds: any integer in [-2**63, 2**64); the
    request's random stream is keyed by the seed's low 32 bits (seed mod 2**32)."""
    _check_real("temperature", self.temperature, lo=0.0)
    _check_int("top_k", self.top_k, 0, INT32_MAX)
    _check_real("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
    if self.seed is not None:
      _check_int("seed", self.seed, -2**63, 2**64 - 1)
    _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
    if not isinstance(self.ignore_eos, bool):
      raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
    ids = self.stop_token_ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
      raise ValueError(f"stop_token_ids must be a sequence of token ids, got {ids!r}")
    for i in ids:
      _check_int("stop_token_ids[]", i, 0, INT32_MAX)
    stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # one string = one stop
    if not hasattr(stop, "__iter__"):
      raise ValueError(f"stop must be a string or a sequence of strings, got {stop!r}")
    for x in stop:
      if not isinstance(x, str) or not x:
        raise ValueError(f"stop strings must be non-empty str, got {x!r}")
    object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
    object.__setattr__(self, "stop", tuple(stop))
    self._check_constraint()
    self._check_processing()
    if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
      raise ValueError(f"lora must be an adapter name (a non-empty str) or None, got "
                       f"{self.lora!r}")

  def _check_processing(self) -> None:
    _check_real("min_p", self.min_p, lo=0.0, hi=1.0)
    _check_real("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
    _check_real("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
    _check_real("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
    _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
    if self.logprobs is not None:
      _check_int("logprobs", self.logprobs, 0, 20)
    lb = self.logit_bias
    if lb is not None:
      items = lb.items() if isinstance(lb, dict) else lb
      try:
        pairs = [(k, v) for k, v in items]
      except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to biases, got {lb!r}") from None
      if len(pairs) > 1024:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most 1024")
      for k, v in pairs:
        _check_int("logit_bias token id", k, 0, INT32_MAX)
        _check_real(f"logit_bias[{k}]", v, lo=-100.0, hi=100.0)
      object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v))
                                                          for k, v in pairs)) or None)

  @property
  def processes_logits(self) -> bool:
    """Penalties, logit_bias or min_p: the step's logits-processing group."""
    return bool(self.min_p or self.presence_penalty or self.frequency_penalty or
                self.repetition_penalty != 1.0 or self.logit_bias)

  def _check_constraint(self) -> None:
    """Shape and type of the structured-output fields; whether a grammar compiles is
    checked by the engine (it needs the tokenizer) before the request is queued."""
    if not isinstance(self.json_object, bool):
      raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
    s = self.json_schema
    if s is not None:
      if isinstance(s, str):
        try:
          parsed = json.loads(s)
        except ValueError as e:
          raise ValueError(f"json_schema is not valid JSON: {e}") from None
      else:
        parsed = s
      if not isinstance(parsed, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (or true/false), got "
                         f"{type(parsed).__name__}")
      if not isinstance(s, str):
        try:
          s = json.dumps(s, allow_nan=False)
        except (TypeError, ValueError) as e:
          raise ValueError(f"json_schema cannot be written as JSON: {e}") from None
        object.__setattr__(self, "json_schema", s)
    for name in ("regex", "grammar"):
      v = getattr(self, name)
      if v is not None and (not isinstance(v, str) or not v):
        raise ValueError(f"{name} must be a non-empty string, got {v!r}")
    c = self.choice
    if c is not None:
      if isinstance(c, (str, bytes)) or not hasattr(c, "__iter__"):
        raise ValueError(f"choice must be a list of strings, got {c!r}")
      c = tuple(c)
      if not c or not all(isinstance(x, str) and x for x in c):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {c!r}")
      object.__setattr__(self, "choice", c)
    given = [k for k in ("json_schema", "regex", "grammar", "choice")
             if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
    if len(given) > 1:
      raise ValueError(f"at most one structured-output constraint per request, got {given}")

  @property
  def constraint(self) -> Optional[Tuple[str, object]]:
    """(kind, spec) of the structured-output constraint, or None."""
    for k in ("json_schema", "regex", "grammar", "choice"):
      if getattr(self, k) is not None:
        return k, getattr(self, k)
    return ("json_object", None) if self.json_object else None
