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
from jaxinfer.engine_config import EngineConfig
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

  def __init__(self, model="smollm2-135m-instruct", config: Optional[EngineConfig] = None,
               **options):
    """model: a name, a path (.gguf, HF safetensors directory, orbax checkpoint) or a
    LoadedModel. config: an EngineConfig (jaxinfer/engine_config.py: every option with its
    default, help and check); keyword options are its fields, set on top of it
    (`LLM(model, max_num_seqs=16)`). Everything is checked before the model loads.

    A few options in brief (EngineConfig says the rest): buckets: a BucketTable or the path
    of one as JSON, default BucketTable.default (8.2.4); warmup: compile every shape of the
    table now, with a progress bar (`warmup_s` holds the seconds); offload: an
    OffloadConfig (8.4.3), whose net device-memory saving goes to the KV pool; mesh:
    "tp:N[,ep:E][,dp:M]" (jaxinfer/sharding.py), num_pages per replica; weight_format="gguf": steps
    of few tokens read the .gguf file's own blocks in place (CPU, one device, 8.4.1)."""
    from jaxinfer.executors.jax_executor import JaxExecutor
    from jaxinfer.loading import LoadedModel, load_model
    try:
      c = (config or EngineConfig()).replace(**options)
    except TypeError as e:  # an unknown option
      raise ValueError(f"{e}; the options are EngineConfig's fields") from None
    self.config = c
    from jaxinfer import sharding
    self.mesh = sharding.MeshSpec.parse(c.mesh)
    groups = sharding.device_groups(self.mesh)
    buckets = BucketTable.from_json(c.buckets) if isinstance(c.buckets, str) else c.buckets
    lora_adapters = dict(c.lora_adapters or {})
    max_loras = min(len(lora_adapters), 8) if c.max_loras is None else c.max_loras
    from jaxinfer.loading.registry import check_weight_format
    check_weight_format(c.weight_format)
    dtype, kv_format, page_size = c.dtype, c.kv_format, c.page_size
    offload, max_lora_rank, draft_model = c.offload, c.max_lora_rank, c.draft_model
    # `model`: a name or path, or an already loaded model (LoadedModel).
    from jaxinfer.loading.registry import with_weight_format
    self.model = with_weight_format(model, c.weight_format) if isinstance(
        model, LoadedModel) else load_model(model, dtype, scan_layers=c.scan_layers,
                                            weight_format=c.weight_format)
    self.cfg = self.model.cfg
    self.cfg.check_tp(self.mesh.tp)
    self.cfg.check_ep(self.mesh.ep)
    self.tokenizer = self.model.tokenizer
    self.max_model_len = min(c.max_model_len or self.cfg.max_position, self.cfg.max_position)
    self.buckets = buckets or BucketTable.default(
        max_tokens=c.max_num_batched_tokens, max_requests=c.max_num_seqs,
        max_pages=-(-self.max_model_len // page_size))
    from jaxinfer.costmodel.lora import kv_pages_taken
    from jaxinfer.costmodel.offload import kv_pages_freed
    from jaxinfer.kv import page_bytes as pool_page_bytes
    bpp = 2 if dtype == "bfloat16" else 4
    page_bytes = pool_page_bytes(self.cfg, kv_format, page_size)  # one group's layers
    num_pages = c.pool_pages(page_bytes, self.buckets.max_requests)
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
    sched = c.scheduler or SchedulerConfig(
        policy=c.scheduling_policy(serving=False), max_running=self.buckets.max_requests,
        token_budget=self.buckets.max_tokens, chunk_size=self.buckets.max_tokens,
        deadline_admission=c.deadline_admission, cache_key=(self.cfg.name, "", kv_format),
        window=self.cfg.windows[0] if len(set(self.cfg.windows)) == 1 else 0)
    eos = tuple(self.cfg.eos_token_ids) + (self.tokenizer.eos_token_ids if self.tokenizer else ())
    from jaxinfer.executors.drafters import make_drafter
    from jaxinfer.runtime.speculative import DraftLengthPolicy
    if c.speculative == "draft_model" and draft_model is not None and not isinstance(
        draft_model, LoadedModel):
      draft_model = load_model(draft_model, dtype, scan_layers=c.scan_layers)
    engines = []
    for devices in groups:  # one replica per data-parallel group of tp x ep devices
      executor = JaxExecutor(self.cfg, self.model.params, num_pages=num_pages,
                             page_size=page_size, kv_format=kv_format, backend=c.attention,
                             offload=offload, q_precision=c.q_precision,
                             lora_adapters=adapters, max_loras=max_loras,
                             max_lora_rank=max_lora_rank if max_loras else 0, devices=devices,
                             ep=self.mesh.ep, gguf_activations=c.gguf_activations)
      drafter = make_drafter(c.speculative,
                             early_exit_layers=c.early_exit_layers or self.cfg.num_layers // 2,
                             draft_model=draft_model, draft_pages=num_pages)
      engines.append(Engine(executor, sched, buckets=self.buckets, tokenizer=self.tokenizer,
                            eos_token_ids=eos, max_model_len=self.max_model_len,
                            prefix_cache=c.prefix_cache, cache_eviction=c.cache_eviction,
                            host_cache_pages=c.host_cache_pages, drafter=drafter,
                            draft_policy=DraftLengthPolicy(c.num_draft, c.adaptive_draft)))
    self.replicas = engines  # one Engine per data-parallel replica
    self.executor = engines[0].executor
    self.engine = engines[0]
    if len(engines) > 1:
      from jaxinfer.runtime.router import Router
      self.engine = Router(engines, c.routing)
    self.warmup_s = self.engine.warmup(progress=True, structured=c.structured_output) \
        if c.warmup else 0.0

  def use_serving_policy(self) -> None:
    """The server calls this before its first request: policy "auto" schedules chunked
    (8.2.2) while serving; an explicit policy, or a scheduler given whole, is kept. The
    engine must be idle."""
    if self.config.policy != "auto" or self.config.scheduler is not None:
      return
    for e in self.replicas:
      e.set_policy(self.config.scheduling_policy(serving=True))

  def add_lora(self, name: str, path: str) -> None:
    """Register one more PEFT adapter (vLLM's load_lora_adapter). Checked fully before
    anything changes: an adapter that does not fit raises AdapterError and the engine
    serves on (weights holding NaN or Inf are refused too). Replacing a name that running
    requests use is refused; re-adding an adapter the engine disabled (its requests' logits
    were non-finite) serves it again."""
    from jaxinfer.lora import load_peft
    if not self.executor.max_loras:
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
