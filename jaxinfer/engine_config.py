"""EngineConfig: every engine option in one place, with its default, its help and its check
(vLLM's EngineArgs). `LLM` takes one (or its fields as keywords); the CLI and the server
define their engine flags from it (`define_flags`) and build it back (`from_flags`).

A field's metadata: `help`; `choices` (an enum flag); `flag` (the flag's name, default the
field's; None: no generated flag, for values that are Python objects, or flags the CLI
parses itself) and `flag_default` / `from_flag` (the flag's value when the field's default
is None, and its conversion: 0 or "" meaning None).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxinfer.buckets import BucketTable
from jaxinfer.runtime.router import ROUTING
from jaxinfer.runtime.scheduler import POLICIES

DTYPES = ("float32", "bfloat16")
KV_FORMATS = ("f32", "bf16", "fp8", "q8_0", "q4_0")
ATTENTION = ("xla", "reference", "pallas")
SPECULATIVE = ("none", "ngram", "early_exit", "draft_model")
WEIGHT_FORMATS = ("dense", "gguf")
GGUF_ACTIVATIONS = ("q8", "f32")
# num_pages=None (auto): the pool holds max_num_seqs requests of this many tokens, within
# these bounds (a pool is zeroed at start-up, so its size is start-up time too)
AUTO_TOKENS_PER_SEQ = 512
AUTO_MIN_PAGES = 1024
AUTO_MAX_KV_BYTES = 4 << 30


def _none_if_falsy(v):
  return v or None


def _opt(default, help: str, *, choices=None, flag: Optional[str] = "", flag_default=None,
         from_flag=None):
  meta = {"help": help, "choices": choices, "flag": flag, "flag_default": flag_default,
          "from_flag": from_flag}
  return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Engine options (see each field's help; `python -m jaxinfer --helpfull` lists them)."""
  dtype: str = _opt("float32", "compute dtype", choices=DTYPES)
  weight_format: str = _opt(
      "dense", "dense: weights dequantized to --dtype; gguf (a .gguf model on CPU): steps of "
      "few tokens multiply by the file's own Q4_0/Q4_1/Q8_0 blocks in place (the same "
      "weights, about 5x fewer bytes read per decode step, 8.4.1)", choices=WEIGHT_FORMATS)
  gguf_activations: str = _opt(
      "q8", "weight_format=gguf: the block products' activations. q8: quantized to 8 bits "
      "per block of 32 and multiplied in integers, as llama.cpp does; f32: float32 products, "
      "equal to the dense weights' up to summation order", choices=GGUF_ACTIVATIONS)
  scan_layers: bool = _opt(
      True, "layer loop: lax.scan over stacked weights (compiles fast), or one block per "
      "layer (each shape compiles slower)", flag="layers", choices=("scan", "unrolled"),
      flag_default="scan", from_flag=lambda v: v == "scan")
  kv_format: str = _opt("f32", "KV cache format (8.4.2)", choices=KV_FORMATS)
  q_precision: str = _opt(
      "compute", "Q against a quantized KV pool: compute dtype, or rounded like the KV (8.4.4)",
      choices=("compute", "kv"))
  attention: str = _opt(
      "xla", "attention backend: xla (XLA ops; on CPU the native decode call), reference "
      "(the jnp oracle), pallas (GPU kernels)", choices=ATTENTION)
  page_size: int = _opt(16, "tokens per KV page")
  num_pages: Optional[int] = _opt(
      None, "KV pool size in pages per replica (0 = auto: room for --max_num_seqs requests "
      f"of {AUTO_TOKENS_PER_SEQ} tokens each, at least {AUTO_MIN_PAGES} pages and at most "
      f"{AUTO_MAX_KV_BYTES >> 30} GiB of KV)", flag_default=0, from_flag=_none_if_falsy)
  max_model_len: Optional[int] = _opt(None, "context window (0 = the model's)",
                                      flag_default=0, from_flag=_none_if_falsy)
  policy: str = _opt(
      "auto", "scheduling policy (8.2). auto: chunked when serving (decodes keep their pace "
      "while prompts arrive, 8.2.2), separate for offline batches (prefills first, each its "
      "own iteration, 8.1.1: the job's throughput and TTFT; docs/performance.md)",
      choices=("auto",) + POLICIES)
  max_num_batched_tokens: int = _opt(256, "largest token bucket: new tokens per step "
                                     "(8.2.4's token budget)")
  max_num_seqs: int = _opt(64, "largest request bucket: requests per step (generate: at most "
                           "the number of prompts unless given)")
  buckets: Any = _opt(None, "a bucket table as JSON (tools/bucket_plan.py writes them); "
                      "default: a small table from --max_num_batched_tokens and "
                      "--max_num_seqs", flag_default=None, from_flag=_none_if_falsy)
  scheduler: Any = _opt(None, "a runtime.scheduler.SchedulerConfig (Python only; default "
                        "from policy / max_num_batched_tokens / max_num_seqs)", flag=None)
  deadline_admission: bool = _opt(False, "reject at once what cannot finish by its deadline "
                                  "(8.6.1; serve: HTTP 503)")
  warmup: bool = _opt(True, "compile every bucket shape before the first request (the "
                      "persistent compilation cache reloads them after the first run; "
                      "--nowarmup compiles each shape the first time a step needs it, "
                      "which `generate` does unless --warmup is given: a one-shot job "
                      "compiles only the shapes it runs)")
  structured_output: bool = _opt(
      False, "the warm-up also compiles each shape's token-masked variant, so constrained "
      "requests never compile mid-traffic (they work without it)")
  prefix_cache: bool = _opt(False, "radix prefix cache (8.3.3)")
  cache_eviction: str = _opt("lru", "prefix cache eviction: lru, or value (8.3.4)",
                             choices=("lru", "value"))
  host_cache_pages: int = _opt(0, "pages of the prefix cache's host-memory tier (8.3.4; "
                               "0 = none)")
  speculative: str = _opt("none", "speculative decoding drafter (8.5)", choices=SPECULATIVE)
  num_draft: int = _opt(4, "longest draft per round (m)")
  adaptive_draft: bool = _opt(False, "per-request draft length by 8.5.4's marginal rule")
  early_exit_layers: Optional[int] = _opt(None, "early_exit: layers of the target used to "
                                          "draft (0 = half)", flag_default=0,
                                          from_flag=_none_if_falsy)
  draft_model: Any = _opt(None, "draft_model: a model name or path sharing the tokenizer "
                          "(e.g. a checkpoint from tools/train_draft.py)", flag_default="",
                          from_flag=_none_if_falsy)
  offload: Any = _opt(None, "a costmodel.offload.OffloadConfig: layers' FFN weights "
                      "streamed from host memory (8.4.3; Python only)", flag=None)
  lora_adapters: Any = _opt(None, "{name: PEFT directory} (CLI: --lora NAME=DIR, repeatable)",
                            flag=None)
  max_loras: Optional[int] = _opt(None, "adapter slots on the device (0: one per --lora, "
                                  "at most 8)", flag_default=0, from_flag=_none_if_falsy)
  max_lora_rank: int = _opt(16, "the largest adapter rank the slots hold")
  mesh: Optional[str] = _opt(None, "devices: 'tp:N[,ep:E][,dp:M]' - each replica tensor "
                             "parallel over N devices (times E expert-parallel groups for a "
                             "mixture of experts), M data-parallel replicas behind a router "
                             "(default: one device)", flag_default="", from_flag=_none_if_falsy)
  routing: str = _opt("prefix", "with dp > 1: send a request to the replica that saw its "
                      "longest prefix (balanced by load), in turn, to the fewest "
                      "outstanding tokens, to the fewer of two drawn at random, or to the "
                      "earliest predicted first token",
                      choices=ROUTING)

  def __post_init__(self):
    self.validate()

  def pool_pages(self, page_bytes: int, max_requests: int) -> int:
    """The KV pool's pages per replica: num_pages, or (None) room for max_requests requests
    of AUTO_TOKENS_PER_SEQ tokens, at least AUTO_MIN_PAGES and at most AUTO_MAX_KV_BYTES
    of pages of page_bytes each (the cap never goes under the minimum)."""
    if self.num_pages is not None:
      return self.num_pages
    want = max_requests * -(-AUTO_TOKENS_PER_SEQ // self.page_size)
    return max(AUTO_MIN_PAGES, min(want, AUTO_MAX_KV_BYTES // max(page_bytes, 1)))

  def scheduling_policy(self, serving: bool) -> str:
    """The scheduler's policy: `policy`, or for "auto" chunked when serving and separate
    for offline batches (whose requests all arrive at once: prefill-first finishes the job
    sooner and gives its first tokens sooner; docs/performance.md has the A/B)."""
    if self.policy != "auto":
      return self.policy
    return "chunked" if serving else "separate"

  def replace(self, **kw) -> "EngineConfig":
    return dataclasses.replace(self, **kw)

  def validate(self) -> None:
    """Every check that needs no model: raises ValueError naming the field, its value and
    the limit (before any weights load)."""
    for f in dataclasses.fields(self):
      choices = f.metadata["choices"]
      v = getattr(self, f.name)
      # (a field converted from its flag, like scan_layers, lists the flag's choices)
      if choices and f.metadata["from_flag"] is None and v not in choices:
        raise ValueError(f"{f.name} must be one of {choices}, got {v!r}")
    for name in ("scan_layers", "deadline_admission", "warmup", "structured_output",
                 "prefix_cache", "adaptive_draft"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    for name, lo in (("page_size", 1), ("num_draft", 1),
                     ("max_num_batched_tokens", 1), ("max_num_seqs", 1),
                     ("host_cache_pages", 0), ("max_lora_rank", 1)):
      _check_int(name, getattr(self, name), lo)
    for name, lo in (("max_model_len", 2), ("early_exit_layers", 1), ("max_loras", 0),
                     ("num_pages", 1)):
      if getattr(self, name) is not None:
        _check_int(name, getattr(self, name), lo)
    if self.buckets is not None and not isinstance(self.buckets, (str, BucketTable)):
      raise ValueError(f"buckets must be a BucketTable or a JSON path, got {self.buckets!r}")
    if self.speculative == "draft_model" and self.draft_model is None:
      raise ValueError("speculative='draft_model' needs draft_model (a name, path or "
                       "LoadedModel)")
    for k, v in dict(self.lora_adapters or {}).items():
      if not isinstance(k, str) or not k or not isinstance(v, str):
        raise ValueError(f"lora_adapters must map adapter names to PEFT directories, got "
                         f"{k!r}: {v!r}")
    if self.lora_adapters and self.max_loras == 0:
      raise ValueError("lora_adapters given with max_loras=0: no slot could serve them")
    if (self.lora_adapters or self.max_loras) and self.offload is not None and \
        self.offload.layers:
      raise ValueError("LoRA adapters cannot be combined with weight offload")
    from jaxinfer import sharding
    mesh = sharding.MeshSpec.parse(self.mesh)
    if self.speculative == "draft_model" and mesh.devices > 1:
      raise ValueError("speculative='draft_model' runs the draft model on one device: not "
                       f"with mesh {mesh}")
    if self.weight_format == "gguf" and (mesh.devices > 1 or (self.offload and
                                                               self.offload.layers)):
      raise ValueError(f"weight_format='gguf' runs on one device without weight offload: not "
                       f"with mesh {mesh} / offload {self.offload}")
    sharding.check_single_device_features(mesh.replica_devices, mesh.dp > 1, self.offload,
                                          bool(self.lora_adapters or self.max_loras))


def _check_int(name: str, v, lo: int) -> None:
  if isinstance(v, bool) or not isinstance(v, int) or v < lo:
    raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def flag_fields():
  """(field, flag name) of every option the command line sets."""
  for f in dataclasses.fields(EngineConfig):
    flag = f.metadata["flag"]
    if flag is not None:
      yield f, flag or f.name


def define_flags(flags) -> None:
  """absl flags for every EngineConfig option (the CLI's and the server's)."""
  for f, name in flag_fields():
    default = f.metadata["flag_default"] if f.metadata["from_flag"] else f.default
    helptext, choices = f.metadata["help"], f.metadata["choices"]
    if choices:
      flags.DEFINE_enum(name, default, list(choices), helptext)
    elif isinstance(default, bool):
      flags.DEFINE_bool(name, default, helptext)
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, helptext)
    else:
      flags.DEFINE_string(name, default, helptext)


def from_flags(values, **overrides) -> EngineConfig:
  """EngineConfig from parsed flags (`values`: an object with the flags as attributes)."""
  kw = {}
  for f, name in flag_fields():
    v = getattr(values, name)
    conv = f.metadata["from_flag"]
    kw[f.name] = conv(v) if conv is not None else v
  kw.update(overrides)
  return EngineConfig(**kw)
