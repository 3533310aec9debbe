"""GGUF weights -> params (dequantized to the compute dtype) and ModelConfig.

Uses the `gguf` package's reader and dequantizers. llama-family files store the
attn_q / attn_k rows permuted for llama.cpp's pairwise RoPE; we undo that to get the
HF layout. Qwen2, Qwen3, Gemma 2/3 and Phi-3 files are not permuted. Gemma files store
each RMSNorm weight as 1 + w (llama.cpp multiplies by it as it is), so their norms take no
offset here; the file does not carry the query scale, which is llama.cpp's for the
family: 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for the 27B models (Gemma 2's 46
layers, Gemma 3's 62), nor always Gemma's layer pattern (llama.cpp's default: every 2nd
layer global in Gemma 2, every 6th in Gemma 3) or Gemma 3's local RoPE base (10,000).
Phi-3 files keep q, k, v fused (attn_qkv) and gate, up fused (ffn_up), as HF does. A
sliding window in the metadata applies to every layer of the other families (Mistral
converted as a Llama file carries one only where the converter wrote it).
"""
from __future__ import annotations

import functools
import logging
import os

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.errors import ModelLoadError

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "qwen3", "qwen2", "gemma2", "gemma3", "phi3")

_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
    "attn_output": "wo", "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up",
    "ffn_down": "w_down", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm",
}
_BIAS_NAMES = {"attn_q": "bq", "attn_k": "bk", "attn_v": "bv"}  # Qwen2
_FUSED_NAMES = {"attn_qkv": "wq+wk+wv", "ffn_up": "w_gate+w_up"}  # Phi-3 (split at load)
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's: every n-th layer global
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def open_gguf(path: str):
  """A read-only GGUFReader of `path`. gguf-py parses every metadata field when it opens
  a file (SmolLM2's 49,152-token vocabulary: 3.7-7.7 s here), and a process opens the same
  file for its weights, its tokenizer and its block weights, so the last one opened is kept
  (keyed by the file's path, size and modification time: a rewritten file is read again)."""
  if not os.path.isfile(path):
    raise ModelLoadError(f"GGUF file not found: {path!r}")
  st = os.stat(path)
  return _open_gguf(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_gguf(path: str, size: int, mtime_ns: int):
  import gguf
  del size, mtime_ns  # the cache key only
  try:
    return gguf.GGUFReader(path, "r")
  except Exception as e:  # the reader raises assorted errors on bad bytes
    raise ModelLoadError(
        f"{path!r} is not a readable GGUF file ({type(e).__name__}: {e}); "
        "check that the download is complete") from e


def field(reader, key, default=None):
  f = reader.fields.get(key)
  if f is None:
    return default
  return f.contents()


def config_from_gguf(reader, name: str | None = None) -> ModelConfig:
  arch = field(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise ModelLoadError(
        f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHS}")
  a = arch
  D = int(field(reader, f"{a}.embedding_length"))
  N = int(field(reader, f"{a}.attention.head_count"))
  K = int(field(reader, f"{a}.attention.head_count_kv", N))
  H = int(field(reader, f"{a}.attention.key_length", D // N))
  names = {t.name for t in reader.tensors}
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  vocab = int(field(reader, f"{a}.vocab_size", len(tokens.data) if tokens else 0))
  eos = field(reader, "tokenizer.ggml.eos_token_id")
  eot = field(reader, "tokenizer.ggml.eot_token_id")
  eos_ids = tuple(int(x) for x in (eot, eos) if x is not None)
  bos = field(reader, "tokenizer.ggml.bos_token_id")
  L = int(field(reader, f"{a}.block_count"))
  if any(n.startswith("rope_factors") for n in names):
    raise ModelLoadError(f"this {arch} GGUF file carries LongRoPE factors (rope_factors_long "
                         "/ short), which jaxinfer does not apply; supported: files without "
                         "them (Phi-3's 4K-context models)")
  if arch in _GEMMA_PATTERN:
    extra = _gemma_fields(reader, a, L, D, N, H)
  else:  # a window in every layer where the file has one (Mistral's, Phi-3's)
    window = int(field(reader, f"{a}.attention.sliding_window", 0) or 0)
    extra = dict(partial_rotary=int(field(reader, f"{a}.rope.dimension_count", H)) / H,
                 layer_windows=(window,) * L if window else ())
  return ModelConfig(
      name=name or str(field(reader, "general.name", arch)),
      family=arch, qkv_bias="blk.0.attn_q.bias" in names, **extra,
      vocab_size=vocab, hidden_size=D,
      intermediate_size=int(field(reader, f"{a}.feed_forward_length")),
      num_layers=L, num_heads=N, num_kv_heads=K,
      head_dim=H, rope_theta=float(field(reader, f"{a}.rope.freq_base", 10000.0)),
      rms_norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
      tie_embeddings="output.weight" not in names,
      max_position=int(field(reader, f"{a}.context_length", 4096)),
      qk_norm="blk.0.attn_q_norm.weight" in names,
      bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(dict.fromkeys(eos_ids)))


def _gemma_fields(reader, a: str, L: int, D: int, N: int, H: int) -> dict:
  """Gemma 2/3's ModelConfig fields from a GGUF file (its layer pattern: a list of
  booleans, True for a windowed layer, or every n-th layer global)."""
  window = int(field(reader, f"{a}.attention.sliding_window", 0) or 0)
  pattern = field(reader, f"{a}.attention.sliding_window_pattern", _GEMMA_PATTERN[a])
  if isinstance(pattern, (list, tuple)):
    if len(pattern) != L:
      raise ModelLoadError(f"{a}.attention.sliding_window_pattern has {len(pattern)} "
                           f"entries for {L} layers")
    local = [bool(x) for x in pattern]
  else:
    local = [i % int(pattern) < int(pattern) - 1 for i in range(L)]
  caps = [field(reader, f"{a}.{k}_logit_softcapping") for k in ("attn", "final")]
  return dict(hidden_act="gelu_tanh", embed_scale=True, sandwich_norms=True,
              query_scale=(D / N if L == _GEMMA_27B_LAYERS[a] else H) ** -0.5,
              attn_softcap=None if caps[0] is None else float(caps[0]),
              final_softcap=None if caps[1] is None else float(caps[1]),
              layer_windows=tuple(window if x else 0 for x in local) if window else (),
              rope_local_theta=float(field(reader, f"{a}.rope.freq_base_swa", 10000.0))
              if a == "gemma3" else None)


def dequantize(tensor) -> np.ndarray:
  """One GGUF tensor -> float32 array in (rows, cols) = (out, in) order."""
  from gguf import quants
  ttype = tensor.tensor_type
  try:
    arr = quants.dequantize(tensor.data, ttype)
  except NotImplementedError as e:
    raise ModelLoadError(
        f"tensor {tensor.name!r} has type {ttype.name}, which the gguf package cannot "
        "dequantize; re-export the model as F16, BF16, Q8_0, Q4_0 or Q4_1") from e
  shape = tuple(int(x) for x in reversed(tensor.shape))  # the reader's shape is reversed
  arr = np.asarray(arr, dtype=np.float32).reshape(shape)
  return arr


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's RoPE row permutation: w [n_heads*H, D] -> HF row order."""
  rows, D = w.shape
  H = rows // n_heads
  return w.reshape(n_heads, H // 2, 2, D).swapaxes(1, 2).reshape(rows, D)


def load_gguf(path: str, name: str | None = None):
  """Returns (params with per-layer lists of numpy float32 arrays, ModelConfig, reader)."""
  reader = open_gguf(path)
  cfg = config_from_gguf(reader, name)
  permuted = field(reader, "general.architecture") == "llama"
  fused = _fused_names(reader)
  layers = [dict() for _ in range(cfg.num_layers)]
  params = {"layers": layers}
  for t in reader.tensors:
    w = dequantize(t)
    parts = t.name.split(".")
    if parts[0] == "blk":
      i, kind = int(parts[1]), parts[2]
      if parts[-1] == "bias" and kind in _BIAS_NAMES:
        layers[i][_BIAS_NAMES[kind]] = w
        continue
      if kind in fused and parts[-1] == "weight":
        layers[i][fused[kind]] = w.T
        continue
      if kind not in _LAYER_NAMES or parts[-1] != "weight":
        log.warning("ignoring unknown GGUF tensor %s", t.name)
        continue
      if permuted and kind == "attn_q":
        w = unpermute_qk(w, cfg.num_heads)
      elif permuted and kind == "attn_k":
        w = unpermute_qk(w, cfg.num_kv_heads)
      layers[i][_LAYER_NAMES[kind]] = w.T if w.ndim == 2 else w
    elif t.name == "token_embd.weight":
      params["embed"] = w  # [V, D]
    elif t.name == "output_norm.weight":
      params["final_norm"] = w
    elif t.name == "output.weight":
      params["lm_head"] = w.T  # [D, V]
    else:
      log.warning("ignoring unknown GGUF tensor %s", t.name)
  if fused:
    from jaxinfer.loading.safetensors_loader import split_fused
    for layer in layers:
      split_fused(layer, cfg)
  missing = [k for k in ("embed", "final_norm") if k not in params]
  if missing or any(len(l) < 9 for l in layers):
    raise ModelLoadError(f"GGUF file {path!r} lacks tensors: {missing or 'some layer weights'}")
  return params, cfg, reader


_MATMUL_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                 "ffn_down", "attn_qkv")


def _fused_names(reader) -> dict:
  """GGUF tensor kind -> the model's fused name, for a file storing projections fused
  (Phi-3: attn_qkv, and ffn_up holding gate then up where no ffn_gate exists)."""
  if field(reader, "general.architecture") != "phi3":
    return {}
  return _FUSED_NAMES


def _blocks_of(t):
  """A Q4_0 / Q4_1 / Q8_0 tensor -> (codes, scales) of pallas_kernels.block_codec."""
  from pallas_kernels import block_codec
  rows, cols = (int(x) for x in reversed(t.shape))  # (out, in)
  kind = t.tensor_type.name.lower()
  if kind not in block_codec.GGUF_FORMATS:
    raise ModelLoadError(
        f"weight_format='gguf' reads Q4_0, Q4_1 and Q8_0 tensors as they are; tensor "
        f"{t.name!r} is {t.tensor_type.name}: use weight_format='dense' for this file")
  return block_codec.from_gguf_blocks(np.asarray(t.data).view(np.uint8), kind, rows, cols)


FUSED_GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"))


def load_blocks(reader, cfg: ModelConfig):
  """The file's matmul weights in their own blocks: {"layers": {name: {"codes": [L, N, C],
  "scales": [L, N, K/32, S]}}, "lm_head": {...}} as numpy arrays (N = out, K = in); the
  groups of FUSED_GROUPS under one name ("wq+wk+wv": q rows, then k, then v)."""
  permuted = field(reader, "general.architecture") == "llama"
  names = dict(_LAYER_NAMES, **_fused_names(reader))
  per_layer: dict = {}
  head = None
  for t in reader.tensors:
    parts = t.name.split(".")
    if parts[0] == "blk" and parts[2] in _MATMUL_KINDS and parts[-1] == "weight":
      codes, scales = _blocks_of(t)
      if permuted and parts[2] in ("attn_q", "attn_k"):  # rows, as for the dense weights
        n = cfg.num_heads if parts[2] == "attn_q" else cfg.num_kv_heads
        shape = scales.shape
        codes = unpermute_qk(codes, n)
        scales = unpermute_qk(scales.reshape(shape[0], -1), n).reshape(shape)
      per_layer.setdefault(names[parts[2]], {})[int(parts[1])] = (codes, scales)
    elif t.name == "output.weight" or (t.name == "token_embd.weight" and cfg.tie_embeddings):
      head = _blocks_of(t)
  layers = {}
  for name, got in per_layer.items():
    if len(got) != cfg.num_layers:
      raise ModelLoadError(f"GGUF file lacks {name} of some layers")
    layers[name] = {"codes": np.stack([got[i][0] for i in range(cfg.num_layers)]),
                    "scales": np.stack([got[i][1] for i in range(cfg.num_layers)])}
  # Projections of the same input in one matrix (rows concatenated) where their formats
  # agree: one native call each instead of three and two (jaxinfer.model.linear.linear_group).
  for group in FUSED_GROUPS:
    parts = [layers.get(n) for n in group]
    if all(w is not None for w in parts) and len({w["scales"].shape[2:] for w in parts}) == 1:
      layers["+".join(group)] = {
          k: np.concatenate([w[k] for w in parts], axis=1) for k in ("codes", "scales")}
      for n in group:
        del layers[n]
  out = {"layers": layers}
  if head is not None:
    out["lm_head"] = {"codes": head[0], "scales": head[1]}
  return out
