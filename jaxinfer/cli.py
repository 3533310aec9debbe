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
flags.DEFINE_string("model", "smollm2-135m-instruct", "model name or path (.gguf / HF dir / checkpoint)")
flags.DEFINE_multi_string("prompt", None, "prompt text; repeat for a batch")
flags.DEFINE_bool("chat", False, "wrap each prompt in the model's chat template")
flags.DEFINE_integer("max_tokens", 64, "maximum new tokens per prompt")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 0, "0 = off")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("seed", 0, "per-request seed (prompt i uses seed + i)")
flags.DEFINE_multi_string("stop", [], "stop string; repeatable")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_string("kv_format", "f32", "KV cache format: f32, bf16, fp8, q8_0, q4_0")
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


def _generate():
  from jaxinfer.config import SamplingParams
  from jaxinfer.llm import LLM
  prompts = FLAGS.prompt or ["Tell me a short fact about the Moon."]
  t0 = time.perf_counter()
  if FLAGS.speculative == "draft_model" and not FLAGS.draft_model:
    raise app.UsageError("--speculative=draft_model needs --draft_model=NAME|PATH")
  llm = LLM(FLAGS.model, dtype=FLAGS.dtype, kv_format=FLAGS.kv_format, page_size=FLAGS.page_size,
            num_pages=FLAGS.num_pages, attention=FLAGS.attention, speculative=FLAGS.speculative,
            num_draft=FLAGS.num_draft, adaptive_draft=FLAGS.adaptive_draft,
            early_exit_layers=FLAGS.early_exit_layers or None,
            draft_model=FLAGS.draft_model or None, q_precision=FLAGS.q_precision)
  t_load = time.perf_counter() - t0
  sps = [SamplingParams(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                        seed=FLAGS.seed + i, max_tokens=FLAGS.max_tokens, stop=tuple(FLAGS.stop))
         for i in range(len(prompts))]
  t1 = time.perf_counter()
  outs = llm.generate(prompts, sps, chat=FLAGS.chat)
  t_gen = time.perf_counter() - t1
  n_out = sum(len(o.token_ids) for o in outs)
  print(f"[jaxinfer] {llm.cfg.name}: load {t_load:.1f}s, generated {n_out} tokens for "
        f"{len(outs)} prompt(s) in {t_gen:.2f}s (includes compilation)", file=sys.stderr)
  for o in outs:
    if FLAGS.json:
      print(strict_json.dumps(o.to_json()))
    else:
      print(o.text)


def _run(argv):
  if len(argv) < 2 or argv[1] != "generate":
    raise app.UsageError("usage: python -m jaxinfer generate [--flags]")
  if len(argv) > 2:
    raise app.UsageError(f"unexpected arguments: {argv[2:]}")
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)
  from jaxinfer.loading.errors import ModelLoadError
  from jaxinfer.llm import RequestTooLargeError
  try:
    _generate()
  except (ModelLoadError, RequestTooLargeError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def main():
  app.run(_run)
