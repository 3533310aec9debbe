"""How many requests' KV fit in a budget (chapter 8.1, 8.3.2), for any model and KV format.

  python -m experiments.capacity --model=qwen3-8b --kv_budget_gib=12 --input_tokens=8192 \
      --output_tokens=256 --shared_prefix=6144 --json
"""
from __future__ import annotations

import dataclasses

from absl import app, flags

from jaxinfer.config import get_model_config
from jaxinfer.kv import bytes_per_token
from jaxinfer.costmodel import accounting
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "qwen3-8b", "model config name")
flags.DEFINE_float("kv_budget_gib", 12.0, "KV budget in GiB")
flags.DEFINE_integer("input_tokens", 2048, "L")
flags.DEFINE_integer("output_tokens", 256, "G")
flags.DEFINE_integer("shared_prefix", 0, "tokens of a prefix shared by every request")
flags.DEFINE_string("kv_format", "bf16", "bf16, fp8, q8_0, q4_0, f32")
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_bool("json", False, "emit JSON")

MIB = 2**20


def main(argv):
  del argv
  cfg = get_model_config(FLAGS.model)
  k = bytes_per_token(cfg, FLAGS.kv_format, FLAGS.page_size)
  cap = accounting.capacity(k, FLAGS.kv_budget_gib * 2**30, FLAGS.input_tokens,
                            FLAGS.output_tokens, FLAGS.page_size, FLAGS.shared_prefix)
  out = dict(model=cfg.name, kv_format=FLAGS.kv_format, kv_budget_gib=FLAGS.kv_budget_gib,
             input_tokens=FLAGS.input_tokens, output_tokens=FLAGS.output_tokens,
             shared_prefix=FLAGS.shared_prefix, **dataclasses.asdict(cap))
  out.update(kv_after_prefill_mib=cap.kv_after_prefill_bytes / MIB,
             kv_end_mib=cap.kv_end_bytes / MIB, shared_prefix_mib=cap.shared_prefix_bytes / MIB,
             private_end_mib=cap.private_end_bytes / MIB)
  if FLAGS.json:
    print(strict_json.dumps(out, indent=1))
    return
  for key, v in out.items():
    print(f"{key:>24}: {v}")


if __name__ == "__main__":
  app.run(main)
