"""`LLM(model=...).generate(prompts, SamplingParams(...))`: batch generation on the Engine.

All prompts of a call are queued at once and the engine's scheduler (continuous
batching with chunked prefill by default) runs them with the paged pool, the prefix
cache (optional) and the bucket table.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, List, Optional, Sequence, Union

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.runtime.engine import Engine, RequestTooLargeError  # noqa: F401 (re-export)
from jaxinfer.runtime.request import Request
from jaxinfer.runtime.scheduler import SchedulerConfig

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


@dataclasses.dataclass
class RequestOutput:
  request_id: object
  prompt: Optional[str]
  prompt_token_ids: List[int]
  token_ids: List[int]
  text: str
  finish_reason: Optional[str]  # "stop" | "length" | "error"
  logprobs: List[float]
  ttft_s: float = 0.0
  decode_tok_s: float = 0.0
  token_times: List[float] = dataclasses.field(default_factory=list)
  cached_tokens: int = 0
  num_preemptions: int = 0
  rounds: int = 0  # speculative verify rounds
  accepted_per_round: float = 0.0
  mean_tokens_per_round: float = 0.0
  error: Optional[str] = None  # why the request failed (finish_reason "error")
  # per output token, SamplingParams.logprobs most likely (token id, logprob); [] if not asked
  top_logprobs: List[list] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.pop("token_times")
    return d

  @classmethod
  def from_request(cls, r: Request) -> "RequestOutput":
    ttft = r.ttft or 0.0
    dec = 0.0
    if len(r.token_times) > 1:
      dec = (len(r.token_times) - 1) / max(r.token_times[-1] - r.token_times[0], 1e-9)
    return cls(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
               token_ids=list(r.output_token_ids), text=r.text, finish_reason=r.finish_reason,
               error=r.error,
               logprobs=list(r.logprobs), ttft_s=ttft, decode_tok_s=dec,
               top_logprobs=[list(t) for t in r.top_logprobs],
               token_times=[t - r.arrival_time for t in r.token_times],
               cached_tokens=r.cached_tokens, num_preemptions=r.num_preemptions,
               rounds=r.spec_rounds,
               accepted_per_round=r.spec_accepted / r.spec_rounds if r.spec_rounds else 0.0,
               mean_tokens_per_round=r.spec_emitted / r.spec_rounds if r.spec_rounds else 0.0)


class LLM:
  """Load a model and generate from batches of prompts."""

  def __init__(self, model="smollm2-135m-instruct", *, dtype: str = "float32",
               kv_format: str = "f32", page_size: int = 16, num_pages: int = 1024,
               max_model_len: Optional[int] = None, attention: str = "xla",
               buckets: Optional[BucketTable] = None, scan_layers: bool = True,
               scheduler: Optional[SchedulerConfig] = None, prefix_cache: bool = False,
               speculative: str = "none", num_draft: int = 4, adaptive_draft: bool = False,
               early_exit_layers: Optional[int] = None, draft_model=None, offload=None,
               q_precision: str = "native", policy: str = "chunked",
               max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
               deadline_admission: bool = False, warmup: bool = True,
               cache_eviction: str = "lru", host_cache_pages: int = 0,
               structured_output: bool = False, lora_adapters=None,
               max_loras: Optional[int] = None, max_lora_rank: int = 16,
               mesh: Optional[str] = None, routing: str = "prefix",
               weight_format: str = "dense"):
    """speculative: none | ngram | early_exit (8.5); num_draft: the longest draft;
    adaptive_draft: choose each request's draft length by 8.5.4's marginal rule;
    draft_model: for speculative="draft_model", a name, path or LoadedModel;
    q_precision: "native" (Q in the compute dtype) or "kv" (Q rounded through the KV
    format's compute path), 8.4.4's storage-vs-compute split;
    policy / max_num_batched_tokens / max_num_seqs / deadline_admission: the scheduler
    (8.2) and the largest token and request buckets, when `buckets` / `scheduler` are not
    given (vLLM's names);
    offload: an OffloadConfig (weights streamed from host memory, 8.4.3); the device memory
    it saves net of the prefetch buffers is given to the KV pool, so admission (which
    reserves pages) admits more requests;
    cache_eviction / host_cache_pages: the prefix cache's eviction policy ("lru" or
    "value", 8.3.4) and the pages of its host-memory tier (evicted prefixes move there and
    come back on a hit instead of being recomputed; 0 = none);
    buckets: a BucketTable or the path of one as JSON (tools/bucket_plan.py writes them);
    default: BucketTable.default (about 82 shapes at 64 requests);
    warmup: compile every shape of the table now, with a progress bar (8.2.4: no request
    then waits for a compile; the persistent compilation cache makes a second process
    mostly reload them). `warmup_s` holds the seconds spent;
    structured_output: the warm-up also compiles each shape's token-masked variant (steps
    that carry json_schema / regex / grammar / choice requests), so a server taking
    constrained requests never compiles mid-traffic; constrained requests work without it,
    each masked variant then compiling at its first use;
    mesh: "tp:N[,dp:M]" (jaxinfer/sharding.py): each replica tensor parallel over N
    devices, M replicas behind a router (runtime/router.py), num_pages per replica;
    routing: the router's policy with dp > 1 ("prefix" or "round_robin");
    weight_format: "dense" (weights dequantized to `dtype`) or "gguf" (a .gguf model on
    CPU, one device: steps of few tokens read the file's own Q4_0 / Q4_1 / Q8_0 blocks in
    place, 8.4.1; the same weights bit for bit, ~5x fewer bytes per decode step)."""
    from jaxinfer.executors.jax_executor import JaxExecutor
    from jaxinfer.loading import LoadedModel, load_model
    if not isinstance(structured_output, bool):
      raise ValueError(f"structured_output must be a bool, got {structured_output!r}")
    if cache_eviction not in ("lru", "value"):
      raise ValueError(f"cache_eviction must be 'lru' or 'value', got {cache_eviction!r}")
    if isinstance(host_cache_pages, bool) or not isinstance(host_cache_pages, int) or \
        host_cache_pages < 0:
      raise ValueError(f"host_cache_pages must be an integer >= 0, got {host_cache_pages!r}")
    for name, v in (("page_size", page_size), ("num_pages", num_pages),
                    ("num_draft", num_draft), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("max_num_seqs", max_num_seqs)):  # checked before the (slow) model load
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    from jaxinfer import sharding
    self.mesh = sharding.MeshSpec.parse(mesh)
    groups = sharding.device_groups(self.mesh)
    from jaxinfer.runtime.router import ROUTING
    if routing not in ROUTING:
      raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
    if speculative == "draft_model" and self.mesh.devices > 1:
      raise ValueError("speculative='draft_model' runs the draft model on one device: not "
                       f"with mesh {self.mesh}")
    sharding.check_single_device_features(self.mesh.tp, self.mesh.dp > 1, offload,
                                          bool(lora_adapters or max_loras))
    from jaxinfer.runtime.scheduler import POLICIES
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
      raise ValueError(f"max_model_len must be an integer >= 2 or None, got {max_model_len!r}")
    if isinstance(buckets, str):
      buckets = BucketTable.from_json(buckets)
    if buckets is not None and not isinstance(buckets, BucketTable):
      raise ValueError(f"buckets must be a BucketTable or a JSON path, got {buckets!r}")
    lora_adapters = dict(lora_adapters or {})
    for k, v in lora_adapters.items():
      if not isinstance(k, str) or not k or not isinstance(v, str):
        raise ValueError(f"lora_adapters must map adapter names to PEFT directories, got "
                         f"{k!r}: {v!r}")
    if max_loras is None:
      max_loras = min(len(lora_adapters), 8)
    for name, v, lo in (("max_loras", max_loras, 0), ("max_lora_rank", max_lora_rank, 1)):
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if lora_adapters and not max_loras:
      raise ValueError("lora_adapters given with max_loras=0: no slot could serve them")
    if max_loras and offload is not None and offload.layers:
      raise ValueError("LoRA adapters cannot be combined with weight offload")
    from jaxinfer.loading.registry import check_weight_format
    check_weight_format(weight_format)
    if weight_format == "gguf" and (self.mesh.devices > 1 or (offload and offload.layers)):
      raise ValueError(f"weight_format='gguf' runs on one device without weight offload: not "
                       f"with mesh {self.mesh} / offload {offload}")
    # `model`: a name or path, or an already loaded model (LoadedModel).
    from jaxinfer.loading.registry import with_weight_format
    self.model = with_weight_format(model, weight_format) if isinstance(
        model, LoadedModel) else load_model(model, dtype, scan_layers=scan_layers,
                                            weight_format=weight_format)
    self.cfg = self.model.cfg
    self.cfg.check_tp(self.mesh.tp)
    self.tokenizer = self.model.tokenizer
    self.max_model_len = min(max_model_len or self.cfg.max_position, self.cfg.max_position)
    self.buckets = buckets or BucketTable.default(
        max_tokens=max_num_batched_tokens, max_requests=max_num_seqs,
        max_pages=-(-self.max_model_len // page_size))
    from jaxinfer.costmodel.lora import kv_pages_taken
    from jaxinfer.costmodel.offload import kv_pages_freed
    from jaxinfer.kv import bytes_per_token
    bpp = 2 if dtype == "bfloat16" else 4
    page_bytes = bytes_per_token(self.cfg, kv_format, page_size) * page_size
    if offload is not None and offload.layers:  # the net saving holds more KV (8.4.3)
      extra = kv_pages_freed(self.cfg, offload, bpp, page_bytes)
      log.info("weight offload frees %.1f MiB net: %d more KV pages",
               extra * page_bytes / 2**20, extra)
      num_pages += extra
    adapters = []
    if max_loras:
      from jaxinfer.lora import load_peft, union_targets
      adapters = [load_peft(p, self.cfg, n, max_rank=max_lora_rank)
                  for n, p in lora_adapters.items()]
      taken = kv_pages_taken(self.cfg, max_loras, max_lora_rank, union_targets(adapters),
                             bpp, page_bytes)
      if taken >= num_pages:
        raise ValueError(f"{max_loras} LoRA slots of rank {max_lora_rank} need {taken} KV "
                         f"pages' memory of the {num_pages}: raise num_pages or lower "
                         "max_loras / max_lora_rank")
      log.info("LoRA slots take %d KV pages' device memory", taken)
      num_pages -= taken
    sched = scheduler or SchedulerConfig(
        policy=policy, max_running=self.buckets.max_requests,
        token_budget=self.buckets.max_tokens, chunk_size=self.buckets.max_tokens,
        deadline_admission=deadline_admission, cache_key=(self.cfg.name, "", kv_format))
    eos = tuple(self.cfg.eos_token_ids) + (self.tokenizer.eos_token_ids if self.tokenizer else ())
    from jaxinfer.executors.drafters import make_drafter
    from jaxinfer.runtime.speculative import DraftLengthPolicy
    if speculative == "draft_model" and draft_model is not None and not isinstance(
        draft_model, LoadedModel):
      draft_model = load_model(draft_model, dtype, scan_layers=scan_layers)
    engines = []
    for devices in groups:  # one replica per data-parallel group of tp devices
      executor = JaxExecutor(self.cfg, self.model.params, num_pages=num_pages,
                             page_size=page_size, kv_format=kv_format, backend=attention,
                             offload=offload, q_precision=q_precision,
                             lora_adapters=adapters, max_loras=max_loras,
                             max_lora_rank=max_lora_rank if max_loras else 0, devices=devices)
      drafter = make_drafter(speculative,
                             early_exit_layers=early_exit_layers or self.cfg.num_layers // 2,
                             draft_model=draft_model, draft_pages=num_pages)
      engines.append(Engine(executor, sched, buckets=self.buckets, tokenizer=self.tokenizer,
                            eos_token_ids=eos, max_model_len=self.max_model_len,
                            prefix_cache=prefix_cache, cache_eviction=cache_eviction,
                            host_cache_pages=host_cache_pages, drafter=drafter,
                            draft_policy=DraftLengthPolicy(num_draft, adaptive_draft)))
    self.replicas = engines  # one Engine per data-parallel replica
    self.executor = engines[0].executor
    self.engine = engines[0]
    if len(engines) > 1:
      from jaxinfer.runtime.router import Router
      self.engine = Router(engines, routing)
    self.warmup_s = self.engine.warmup(progress=True, structured=structured_output) \
        if warmup else 0.0

  def add_lora(self, name: str, path: str) -> None:
    """Register one more PEFT adapter (vLLM's load_lora_adapter). Checked fully before
    anything changes: an adapter that does not fit raises AdapterError and the engine
    serves on (weights holding NaN or Inf are refused too). Replacing a name that running
    requests use is refused; re-adding an adapter the engine disabled (its requests' logits
    were non-finite) serves it again."""
    from jaxinfer.lora import load_peft
    if self.executor.lora_pool is None:
      raise ValueError("this LLM has no LoRA slots: construct it with max_loras >= 1")
    if not isinstance(name, str) or not name:
      raise ValueError(f"adapter name must be a non-empty str, got {name!r}")
    if not isinstance(path, str):
      raise ValueError(f"adapter path must be a str (a PEFT directory), got {path!r}")
    adapter = load_peft(path, self.cfg, name, max_rank=self.executor.lora_rank)
    if any(e.scheduler.adapters.users.get(name) for e in self.replicas):
      raise ValueError(f"LoRA adapter {name!r} is in use by running requests")
    for e in self.replicas:
      e.executor.register_lora(adapter)
      e.scheduler.adapters.forget(name)  # a replaced adapter is loaded afresh at next use
      e.disabled_loras.pop(name, None)

  @classmethod
  def from_loaded(cls, loaded, **kw) -> "LLM":
    return cls(loaded, **kw)

  def encode_prompt(self, prompt: Prompt, chat: bool = False) -> List[int]:
    if not isinstance(prompt, str):
      return list(prompt)
    if self.tokenizer is None:
      raise ValueError(f"model {self.cfg.name!r} has no tokenizer: pass prompts as token ids")
    try:
      prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # e.g. a lone surrogate from a bad decode upstream
      raise ValueError(f"prompt is not valid Unicode text: {e.reason} at character "
                       f"{e.start} ({prompt[e.start:e.end]!r})") from None
    if chat:
      prompt = self.chat_prompt([{"role": "user", "content": prompt}])
    return self.tokenizer.encode(prompt)

  def chat_prompt(self, messages: Sequence[dict]) -> str:
    """Chat messages ({"role": system | user | assistant, "content": str}, several turns)
    rendered with the model's chat template, ready for the assistant's answer."""
    if self.tokenizer is None:
      raise ValueError(f"model {self.cfg.name!r} has no tokenizer: no chat template")
    if isinstance(messages, dict) or not messages:
      raise ValueError("messages must be a non-empty list of {role, content} dicts")
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
          "system", "user", "assistant"):
        raise ValueError(f"messages[{i}] must be {{'role': system|user|assistant, "
                         f"'content': str}}, got {m!r}")
    return self.tokenizer.apply_chat_template(list(messages))

  def chat(self, conversations: Sequence, params=None) -> List[RequestOutput]:
    """One answer per conversation (a list of messages, or a list of such lists)."""
    if conversations and isinstance(conversations[0], dict):
      conversations = [conversations]
    return self.generate([self.chat_prompt(c) for c in conversations], params)

  def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
             chat: bool = False) -> Iterator[str]:
    """Generate one answer, yielding text as it becomes final: never half a UTF-8
    character, never text that may still become a stop string (serving/detokenizer.py).
    Closing the generator early aborts the request and leaves the engine empty; a request
    that ends with an error or an unmet constraint raises RuntimeError after its text."""
    from jaxinfer.serving.detokenizer import IncrementalDetokenizer
    if self.tokenizer is None:
      raise ValueError(f"model {self.cfg.name!r} has no tokenizer: nothing to stream as text")
    params = params or SamplingParams()
    ids = self.encode_prompt(prompt, chat)
    r = self.engine.add_request(ids, params, prompt=prompt if isinstance(prompt, str) else None)
    detok = IncrementalDetokenizer(self.tokenizer, params.stop)
    sent = 0
    try:
      while not r.state.done:
        self.engine.step()
        n = len(r.output_token_ids)
        if n > sent and not r.state.done:
          piece = detok.push(r.output_token_ids[sent:n])
          sent = n
          if piece:
            yield piece
      if r.finish_reason in ("error", "constraint"):
        what = "failed" if r.finish_reason == "error" else "could not meet its constraint"
        raise RuntimeError(f"generation {what}: {r.error}")
      rest = detok.finish(r.text or "")
      if rest:
        yield rest
    finally:  # early close, an error or Ctrl-C: leave the engine empty and healthy
      if not r.state.done:
        self.engine.abort_requests([r.request_id])

  def stream_chat(self, messages: Sequence[dict],
                  params: Optional[SamplingParams] = None) -> Iterator[str]:
    return self.stream(self.chat_prompt(messages), params)

  def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
               params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               chat: bool = False) -> List[RequestOutput]:
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    params = params or SamplingParams()
    sps = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(sps) != len(prompts):
      raise ValueError(f"{len(sps)} SamplingParams for {len(prompts)} prompts")
    encoded = [self.encode_prompt(p, chat) for p in prompts]
    for ids, sp in zip(encoded, sps):  # validate everything before queueing anything
      self.engine.validate_request(ids, sp)
    reqs = []
    try:
      for p, ids, sp in zip(prompts, encoded, sps):
        reqs.append(self.engine.add_request(ids, sp, prompt=p if isinstance(p, str) else None))
      while any(not r.state.done for r in reqs):
        self.engine.step()
    except BaseException:  # an error or Ctrl-C: leave the engine empty and healthy
      self.engine.abort_requests([r.request_id for r in reqs])
      raise
    return [RequestOutput.from_request(r) for r in reqs]
