"""Command line: `python -m jaxinfer generate ...` (absl flags).

Results go to stdout (text, or one JSON object per prompt with --json); a progress and
timing line goes to stderr.
"""
from __future__ import annotations

import sys
import time

from absl import app, flags
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "model name or path (.gguf / HF dir / checkpoint)")
flags.DEFINE_multi_string("prompt", None, "prompt text; repeat for a batch")
flags.DEFINE_bool("chat", False, "wrap each prompt in the model's chat template")
flags.DEFINE_integer("max_tokens", 64, "maximum new tokens per prompt")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 0, "0 = off")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("seed", 0, "per-request seed (prompt i uses seed + i)")
flags.DEFINE_multi_string("stop", [], "stop string; repeatable")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_enum("kv_format", "f32", ["f32", "bf16", "fp8", "q8_0", "q4_0"], "KV cache format")
flags.DEFINE_enum("q_precision", "native", ["native", "kv"],
                  "Q against a quantized KV pool: compute dtype, or rounded like the KV (8.4.4)")
flags.DEFINE_enum("attention", "xla", ["xla", "reference", "pallas"],
                  "attention backend: xla (XLA ops laid out for CPU), reference (the jnp "
                  "oracle), pallas (GPU kernels)")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("num_pages", 1024, "KV pool size in pages")
flags.DEFINE_bool("json", False, "print one JSON object per prompt")
flags.DEFINE_enum("speculative", "none", ["none", "ngram", "early_exit", "draft_model"],
                  "speculative decoding drafter (8.5)")
flags.DEFINE_integer("num_draft", 4, "longest draft per round (m)")
flags.DEFINE_bool("adaptive_draft", False, "per-request draft length by 8.5.4's marginal rule")
flags.DEFINE_integer("early_exit_layers", 0, "early_exit: layers of the target used to draft "
                     "(0 = half)")
flags.DEFINE_string("draft_model", "", "draft_model: a model name or path sharing the "
                    "tokenizer (e.g. a checkpoint from tools/train_draft.py)")


def _sampling_params(n):
  """Checked before the model loads: a bad value is one line and exit 2, not a traceback
  after a 10 s load."""
  from jaxinfer.config import SamplingParams
  try:
    return [SamplingParams(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                           seed=FLAGS.seed + i, max_tokens=FLAGS.max_tokens,
                           stop=tuple(FLAGS.stop)) for i in range(n)]
  except ValueError as e:
    _usage_error(str(e))


def _usage_error(msg: str):
  """Argument errors: one line on stderr, exit 2, before anything loads."""
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def _generate():
  from jaxinfer.llm import LLM
  prompts = FLAGS.prompt or ["Tell me a short fact about the Moon."]
  t0 = time.perf_counter()
  if FLAGS.speculative == "draft_model" and not FLAGS.draft_model:
    _usage_error("--speculative=draft_model needs --draft_model=NAME|PATH")
  for name in ("page_size", "num_pages", "num_draft"):
    if getattr(FLAGS, name) < 1:
      _usage_error(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  for i, p in enumerate(prompts):
    try:
      p.encode("utf-8")
    except UnicodeEncodeError:
      _usage_error(f"--prompt #{i + 1} is not valid UTF-8 text (the shell passed bytes "
                   "that do not decode)")
  sps = _sampling_params(len(prompts))
  llm = LLM(FLAGS.model, dtype=FLAGS.dtype, kv_format=FLAGS.kv_format, page_size=FLAGS.page_size,
            num_pages=FLAGS.num_pages, attention=FLAGS.attention, speculative=FLAGS.speculative,
            num_draft=FLAGS.num_draft, adaptive_draft=FLAGS.adaptive_draft,
            early_exit_layers=FLAGS.early_exit_layers or None,
            draft_model=FLAGS.draft_model or None, q_precision=FLAGS.q_precision)
  t_load = time.perf_counter() - t0
  t1 = time.perf_counter()
  outs = llm.generate(prompts, sps, chat=FLAGS.chat)
  t_gen = time.perf_counter() - t1
  n_out = sum(len(o.token_ids) for o in outs)
  print(f"[jaxinfer] {llm.cfg.name}: load {t_load:.1f}s, generated {n_out} tokens for "
        f"{len(outs)} prompt(s) in {t_gen:.2f}s (includes compilation)", file=sys.stderr)
  for i, o in enumerate(outs):
    if FLAGS.json:
      print(strict_json.dumps(o.to_json()))
    elif len(outs) > 1:  # several prompts: label each answer
      print(f"--- [{i + 1}] {o.prompt!r}\n{o.text}")
    else:
      print(o.text)


USAGE = ("usage: python -m jaxinfer generate [--flags]   (--help lists the flags)\n"
         "       python -m jaxinfer cache list|clear   (converted weights, compiled steps)")


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
      what = "compiled steps" if e == "xla" else "?"
      cfg = os.path.join(path, "model_config.json")
      if os.path.isfile(cfg):
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
  if len(argv) < 2 or argv[1] != "generate":
    _usage_error(USAGE.replace("\n", " | "))
  if len(argv) > 2:
    _usage_error(f"unexpected arguments: {argv[2:]}")
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)
  from jaxinfer.loading.errors import ModelLoadError
  from jaxinfer.llm import RequestTooLargeError
  try:
    _generate()
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
