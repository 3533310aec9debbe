"""Command line: `python -m jaxinfer generate ...` and `python -m jaxinfer serve ...`
(absl flags).

generate: results go to stdout (text, or one JSON object per prompt with --json); a
progress and timing line goes to stderr. serve: an OpenAI-compatible HTTP server
(jaxinfer/serving) until SIGTERM / Ctrl-C.
"""
from __future__ import annotations

import sys
import time

from absl import app, flags
from jaxinfer import engine_config, strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "model name or path (.gguf / HF dir / checkpoint)")
engine_config.define_flags(flags)  # every engine option, from EngineConfig
flags.adopt_module_key_flags(engine_config)  # listed by --help with the CLI's own
flags.DEFINE_multi_string("prompt", None, "prompt text; repeat for a batch")
flags.DEFINE_bool("chat", False, "wrap each prompt in the model's chat template")
flags.DEFINE_integer("max_tokens", 64, "maximum new tokens per prompt")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 0, "0 = off")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("seed", 0, "per-request seed (prompt i uses seed + i)")
flags.DEFINE_multi_string("stop", [], "stop string; repeatable")
flags.DEFINE_float("min_p", 0.0, "drop tokens below min_p x the top token's probability")
flags.DEFINE_float("presence_penalty", 0.0, "-p for every token already in the output")
flags.DEFINE_float("frequency_penalty", 0.0, "-f x the token's count in the output")
flags.DEFINE_float("repetition_penalty", 1.0, "over prompt and output tokens (1 = off)")
flags.DEFINE_integer("min_tokens", 0, "EOS cannot end an answer before this many tokens")
flags.DEFINE_integer("logprobs", None, "--json: the N most likely tokens at each step (<= 20)")
flags.DEFINE_bool("json", False, "print one JSON object per prompt")
flags.DEFINE_bool("stream", False, "generate: print the answer as it is produced (one prompt)")
flags.DEFINE_string("system", None, "generate --chat: a system message before each prompt")
flags.DEFINE_float("deadline_s", 0.0, "serve: each request's deadline in seconds from arrival "
                   "(0 = none; a request may set its own with the field deadline_s)")
flags.DEFINE_string("json_schema", None, "generate: a JSON Schema file; every answer is JSON "
                    "that validates against it (structured output)")
flags.DEFINE_bool("json_object", False, "generate: every answer is a JSON object")
flags.DEFINE_string("regex", None, "generate: every answer matches this regular expression")
flags.DEFINE_string("grammar", None, "generate: a context-free grammar file (Lark or "
                    "llama.cpp GBNF); every answer is a sentence of it")
flags.DEFINE_multi_string("choice", [], "generate: the answer is exactly one of these "
                          "strings; repeatable")
flags.DEFINE_multi_string("lora", [], "a LoRA adapter as NAME=PEFT_DIR; repeatable (8.2.1). "
                          "serve: requests pick one with model=NAME")
flags.DEFINE_string("lora_name", None, "generate: run the prompts with this --lora adapter")
flags.DEFINE_string("coordinator", None, "several processes (jax.distributed): HOST:PORT of "
                    "process 0; also JAXINFER_COORDINATOR")
flags.DEFINE_integer("num_processes", None, "several processes: how many (also "
                     "JAXINFER_NUM_PROCESSES)")
flags.DEFINE_integer("process_id", None, "several processes: this one's id in [0, "
                     "num_processes) (also JAXINFER_PROCESS_ID)")
flags.DEFINE_string("host", "127.0.0.1", "serve: address to bind")
flags.DEFINE_integer("port", 8000, "serve: TCP port")
flags.DEFINE_string("api_key", None, "serve: require `Authorization: Bearer <key>`")
flags.DEFINE_integer("max_queue", 256, "serve: requests waiting for admission before new "
                     "ones get HTTP 429")
flags.DEFINE_integer("default_max_tokens", 512, "serve: max_tokens of a chat request that "
                     "sets none (capped by the context window)")
flags.DEFINE_integer("max_body_bytes", 16 << 20, "serve: larger request bodies get HTTP 413 "
                     "before the rest is read")
flags.DEFINE_integer("max_prompt_chars", 2_000_000, "serve: longer prompts (characters, all "
                     "chat messages together) get HTTP 400 before they are tokenized")
flags.DEFINE_float("drain_timeout_s", 30.0, "serve: on SIGTERM / SIGINT, how long requests "
                   "in flight may run on before they are aborted (each client is told)")
flags.DEFINE_string("served_model_name", None, "serve: the model id clients use (default: "
                    "--model)")


def _sampling_params(n):
  """Checked before the model loads: a bad value is one line and exit 2, not a traceback
  after a 10 s load."""
  from jaxinfer.config import SamplingParams
  constraint = _constraint_flags()
  try:
    sps = [SamplingParams(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                          seed=FLAGS.seed + i, max_tokens=FLAGS.max_tokens,
                          stop=tuple(FLAGS.stop), min_p=FLAGS.min_p,
                          presence_penalty=FLAGS.presence_penalty,
                          frequency_penalty=FLAGS.frequency_penalty,
                          repetition_penalty=FLAGS.repetition_penalty,
                          min_tokens=FLAGS.min_tokens, logprobs=FLAGS.logprobs,
                          lora=FLAGS.lora_name, **constraint)
           for i in range(n)]
    if sps[0].constraint is not None:  # compiles without the tokenizer: before the load
      from jaxinfer.structured import check_constraint
      check_constraint(*sps[0].constraint)
    return sps
  except ValueError as e:
    _usage_error(str(e))


def _constraint_flags() -> dict:
  """--json_schema / --json_object / --regex / --grammar / --choice as SamplingParams
  fields (files read here; a missing or unreadable file is a usage error)."""
  out = {}
  for flag, field in (("json_schema", "json_schema"), ("grammar", "grammar")):
    path = getattr(FLAGS, flag)
    if path is None:
      continue
    try:
      with open(path, encoding="utf-8") as f:
        out[field] = f.read()
    except (OSError, UnicodeDecodeError) as e:
      _usage_error(f"--{flag}={path}: {e}")
  if FLAGS.regex is not None:
    out["regex"] = FLAGS.regex
  if FLAGS.choice:
    out["choice"] = tuple(FLAGS.choice)
  if FLAGS.json_object:
    out["json_object"] = True
  if len(out) > 1:
    _usage_error(f"give at most one of --json_schema, --json_object, --regex, --grammar, "
                 f"--choice (got {', '.join('--' + k for k in out)})")
  return out


def _usage_error(msg: str):
  """Argument errors: one line on stderr, exit 2, before anything loads."""
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def _check_engine_flags():
  """Usage errors before anything loads; returns the --buckets table (parsed once) or
  None."""
  if FLAGS.speculative == "draft_model" and not FLAGS.draft_model:
    _usage_error("--speculative=draft_model needs --draft_model=NAME|PATH")
  for name in ("page_size", "num_draft", "max_num_batched_tokens", "max_num_seqs"):
    if getattr(FLAGS, name) < 1:
      _usage_error(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  if FLAGS.num_pages < 0:
    _usage_error(f"--num_pages must be 0 (auto) or >= 1, got {FLAGS.num_pages}")
  loras = _lora_flags()
  if FLAGS.lora_name is not None and FLAGS.lora_name not in loras:
    _usage_error(f"--lora_name={FLAGS.lora_name}: no such --lora (given: {sorted(loras)})")
  if FLAGS.max_loras < 0 or FLAGS.max_lora_rank < 1:
    _usage_error(f"--max_loras must be >= 0 and --max_lora_rank >= 1, got {FLAGS.max_loras} "
                 f"and {FLAGS.max_lora_rank}")
  if FLAGS.max_model_len < 0 or FLAGS.max_model_len == 1:
    _usage_error(f"--max_model_len must be 0 (the model's) or >= 2, got {FLAGS.max_model_len}")
  from jaxinfer import sharding
  try:  # before the first JAX call: a multi-process job joins here
    sharding.initialize_distributed(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    spec = sharding.MeshSpec.parse(FLAGS.mesh)
    sharding.device_groups(spec)
    from jaxinfer.config import MODEL_CONFIGS
    if FLAGS.model in MODEL_CONFIGS:  # a known config: tp checked before the load
      MODEL_CONFIGS[FLAGS.model].check_tp(spec.tp)
      MODEL_CONFIGS[FLAGS.model].check_ep(spec.ep)
  except ValueError as e:
    _usage_error(str(e))
  if not FLAGS.buckets:
    return None
  from jaxinfer.buckets import BucketTable
  try:
    return BucketTable.from_json(FLAGS.buckets)
  except (OSError, ValueError) as e:
    _usage_error(f"--buckets={FLAGS.buckets}: {e}")


def _lora_flags() -> dict:
  """--lora NAME=DIR flags as {name: dir}; each directory must exist."""
  import os
  out = {}
  for item in FLAGS.lora:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
      _usage_error(f"--lora={item}: expected NAME=PEFT_DIR")
    if name in out:
      _usage_error(f"--lora: adapter name {name!r} given twice")
    if not os.path.isdir(path):
      _usage_error(f"--lora={item}: {path} is not a directory")
    out[name] = path
  return out


def _make_llm(buckets, max_num_seqs=None, structured_output=False, warmup=None):
  from jaxinfer.llm import LLM
  try:
    config = engine_config.from_flags(
        FLAGS, buckets=buckets, max_num_seqs=max_num_seqs or FLAGS.max_num_seqs,
        structured_output=structured_output, lora_adapters=_lora_flags(),
        warmup=FLAGS.warmup if warmup is None else warmup)
  except ValueError as e:
    _usage_error(str(e))
  return LLM(FLAGS.model, config)


def _serve():
  from jaxinfer.serving.server import serve
  buckets = _check_engine_flags()
  if not 0 <= FLAGS.port < 65536:
    _usage_error(f"--port must be in [0, 65535], got {FLAGS.port}")
  import jax
  if jax.process_count() > 1:  # every process would bind the port and take its own traffic
    _usage_error("serve runs in one process (tp and dp over that process's devices); a "
                 "multi-process job (--coordinator) runs generate")
  if FLAGS.max_queue < 1 or FLAGS.default_max_tokens < 1 or FLAGS.deadline_s < 0:
    _usage_error("--max_queue and --default_max_tokens must be >= 1, --deadline_s >= 0")
  for name in ("max_body_bytes", "max_prompt_chars"):
    if getattr(FLAGS, name) < 1:
      _usage_error(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  if not 0 <= FLAGS.drain_timeout_s < float("inf"):
    _usage_error(f"--drain_timeout_s must be a finite number >= 0, got {FLAGS.drain_timeout_s}")
  t0 = time.perf_counter()
  # warm-up (on by default) logs its shape count and seconds
  llm = _make_llm(buckets, structured_output=FLAGS.structured_output)
  print(f"[jaxinfer] {llm.cfg.name} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
  serve(llm, model_name=FLAGS.served_model_name or FLAGS.model, host=FLAGS.host,
        port=FLAGS.port, api_key=FLAGS.api_key, max_queue=FLAGS.max_queue,
        default_max_tokens=FLAGS.default_max_tokens, deadline_s=FLAGS.deadline_s or None,
        drain_s=FLAGS.drain_timeout_s, max_body_bytes=FLAGS.max_body_bytes,
        max_prompt_chars=FLAGS.max_prompt_chars)


def _generate():
  prompts = FLAGS.prompt or ["Tell me a short fact about the Moon."]
  t0 = time.perf_counter()
  buckets = _check_engine_flags()
  if FLAGS.system is not None and not FLAGS.chat:
    _usage_error("--system needs --chat (it is a chat message)")
  for i, p in enumerate(prompts):
    try:
      p.encode("utf-8")
    except UnicodeEncodeError:
      _usage_error(f"--prompt #{i + 1} is not valid UTF-8 text (the shell passed bytes "
                   "that do not decode)")
  sps = _sampling_params(len(prompts))
  if FLAGS.stream and len(prompts) > 1:
    _usage_error("--stream prints one answer as it is produced: give one --prompt")
  # A batch never runs more requests than it has prompts: the table (and its warm-up)
  # need no larger request buckets unless --max_num_seqs says otherwise.
  # A one-shot job compiles (or reloads from the persistent cache) only the shapes it
  # runs, at their first step, unless --warmup is given (docs/design.md, start-up).
  warmup = bool(FLAGS["warmup"].present) and FLAGS.warmup
  llm = _make_llm(buckets, None if FLAGS["max_num_seqs"].present else min(
      len(prompts), FLAGS.max_num_seqs), structured_output=sps[0].constraint is not None,
      warmup=warmup)
  t_load = time.perf_counter() - t0
  load = (f"load {t_load - llm.warmup_s:.1f}s + warm-up {llm.warmup_s:.1f}s"
          if warmup else f"load {t_load:.1f}s")
  comp = "" if warmup else " (includes compilation)"
  t1 = time.perf_counter()
  msgs = (lambda p: ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) +
          [{"role": "user", "content": p}])
  if FLAGS.stream:
    try:
      for piece in (llm.stream_chat(msgs(prompts[0]), sps[0]) if FLAGS.chat
                    else llm.stream(prompts[0], sps[0])):
        print(piece, end="", flush=True)
    except RuntimeError as e:  # the request ended with an error: said, and exit 1
      print()
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)
    print()
    print(f"[jaxinfer] {llm.cfg.name}: {load}, streamed in "
          f"{time.perf_counter() - t1:.2f}s{comp}", file=sys.stderr)
    return
  if FLAGS.chat:
    outs = llm.chat([msgs(p) for p in prompts], sps)
  else:
    outs = llm.generate(prompts, sps)
  t_gen = time.perf_counter() - t1
  import jax
  if jax.process_index() != 0:  # a multi-process job: process 0 prints
    return
  n_out = sum(len(o.token_ids) for o in outs)
  print(f"[jaxinfer] {llm.cfg.name}: {load}, generated {n_out} tokens for "
        f"{len(outs)} prompt(s) in {t_gen:.2f}s{comp}", file=sys.stderr)
  for i, o in enumerate(outs):
    if FLAGS.json:
      print(strict_json.dumps(o.to_json()))
    elif len(outs) > 1:  # several prompts: label each answer
      print(f"--- [{i + 1}] {o.prompt!r}\n{o.text}")
    else:
      print(o.text)
  failed = [(i, o) for i, o in enumerate(outs) if o.finish_reason in ("error", "constraint")]
  for i, o in failed:  # said on stderr in every mode; the exit code tells the caller
    which = f"prompt #{i + 1}" if len(outs) > 1 else "the request"
    what = "failed" if o.finish_reason == "error" else "could not meet its constraint"
    print(f"error: {which} {what}: {o.error}", file=sys.stderr)
  if failed:
    sys.exit(1)


USAGE = ("usage: python -m jaxinfer generate [--flags]   (--help lists the flags)\n"
         "       python -m jaxinfer serve [--flags]      (OpenAI-compatible HTTP server)\n"
         "       python -m jaxinfer cache list|clear   (converted weights, compiled code)")


def _cache(action: str) -> None:
  """List or clear the caches under JAXINFER_CACHE (default ~/.cache/jaxinfer)."""
  import json
  import os
  import shutil
  from jaxinfer.loading.registry import default_cache_dir
  root = default_cache_dir()
  entries = sorted(os.listdir(root)) if os.path.isdir(root) else []

  def size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)

  if action == "list":
    print(f"{root}:")
    for e in entries:
      path = os.path.join(root, e)
      what = {"xla": "compiled steps",
              "native": "the built native CPU library (decode attention, block matmul)",
              "hf": "HF transformers' float32 copies of GGUF models (the benchmarks' peer)"}.get(
          e, "?")
      cfg = os.path.join(path, "model_config.json")
      arrays = os.path.join(path, "checksum")
      if not os.path.isfile(cfg) and os.path.isfile(arrays):
        try:
          with open(arrays) as f:
            what = json.load(f).get("what", what)
        except (OSError, ValueError, AttributeError):
          pass
      if e.endswith(".tokenizer") and os.path.isfile(os.path.join(path,
                                                                  "tokenizer_meta.json")):
        what = "the tokenizer of the converted weights beside it"
      elif os.path.isfile(cfg):
        with open(cfg) as f:
          what = f"converted weights of {json.load(f).get('name', '?')}"
      print(f"  {e}  {size(path) / 2**20:9.1f} MiB  {what}")
    if not entries:
      print("  (empty)")
  else:
    for e in entries:
      shutil.rmtree(os.path.join(root, e), ignore_errors=True)
    print(f"removed {len(entries)} entries from {root}")


def _run(argv):
  if len(argv) == 3 and argv[1] == "cache" and argv[2] in ("list", "clear"):
    return _cache(argv[2])
  if len(argv) < 2 or argv[1] not in ("generate", "serve"):
    _usage_error(USAGE.replace("\n", " | "))
  if len(argv) > 2:
    _usage_error(f"unexpected arguments: {argv[2:]}")
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)
  from jaxinfer.loading.errors import ModelLoadError
  from jaxinfer.llm import RequestTooLargeError
  try:
    _serve() if argv[1] == "serve" else _generate()
  except (ModelLoadError, RequestTooLargeError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _parse_flags(argv):
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _usage_error(str(e))


def main():
  if any(a in ("--help", "-h", "--helpshort", "-?") for a in sys.argv[1:]):
    print(USAGE + "\n\n" + FLAGS.module_help(sys.modules[__name__]))
    sys.exit(0)
  app.run(_run, flags_parser=_parse_flags)
