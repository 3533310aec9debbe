"""Plan a bucket table for a trace: the fewest compiled shapes for the least padding.

  python tools/bucket_plan.py --trace=configs/traces/chat_synthetic.jsonl --max_shapes=32 \
      --output=out/buckets.json
  python -m jaxinfer serve --buckets=out/buckets.json

The trace (JSON lines of arrival_s, prompt_tokens, output_tokens) runs through the
scheduler on the virtual clock; the table is fitted to the steps it produced
(jaxinfer.bucket_plan.fit_table) and printed beside the fixed ladders with the padding
each pays on the same steps. The JSON holds the table under "table" (what --buckets
reads) and the comparison.
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", "configs/traces/chat_synthetic.jsonl", "JSON lines trace")
flags.DEFINE_integer("max_shapes", 32, "at most this many compiled executables")
flags.DEFINE_integer("max_num_batched_tokens", 256, "largest token bucket (the step budget)")
flags.DEFINE_integer("max_num_seqs", 64, "largest request bucket")
flags.DEFINE_integer("max_model_len", 4096, "context window: the one page tier")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_enum("policy", "chunked", ["chunked", "continuous", "fixed"], "scheduler policy")
flags.DEFINE_integer("max_sizes", 5, "sizes per axis the search tries (1..this)")
flags.DEFINE_string("cost", "smollm2-135m-instruct@local-cpu", "what a step costs: "
                    "'model@hardware' (seconds on the calibrated roofline) or 'rows' (token "
                    "rows + prefill query rows)")
flags.DEFINE_string("output", "", "write the table and the comparison as JSON here")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  from jaxinfer import bucket_plan as bp
  from jaxinfer import strict_json
  from jaxinfer.costmodel.accounting import pages_for
  for name in ("max_shapes", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
               "page_size", "max_sizes"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  try:
    trace = bp.load_trace(FLAGS.trace)
  except (OSError, ValueError) as e:
    raise app.UsageError(f"--trace={FLAGS.trace}: {e}")
  T, R = FLAGS.max_num_batched_tokens, FLAGS.max_num_seqs
  P = pages_for(FLAGS.max_model_len, FLAGS.page_size)
  too_long = [i for i, r in enumerate(trace) if r["prompt_tokens"] + r["output_tokens"] >
              FLAGS.max_model_len]
  if too_long:
    raise app.UsageError(f"{len(too_long)} trace requests exceed --max_model_len="
                         f"{FLAGS.max_model_len} (first: line {too_long[0] + 1})")
  try:
    cost = bp.rows_cost if FLAGS.cost == "rows" else bp.roofline_cost(FLAGS.cost)
  except (OSError, ValueError) as e:
    raise app.UsageError(f"--cost={FLAGS.cost}: {e}")
  shapes = bp.trace_step_shapes(trace, T, R, FLAGS.policy, FLAGS.page_size)
  table, info = bp.fit_table(shapes, FLAGS.max_shapes, T, R, P, FLAGS.max_sizes, cost)
  rows = {"fitted": {"num_shapes": info["num_shapes"], **bp.padding(table, shapes, cost)}}
  for s in ("pow2", "pow4", "linear"):
    t = bp.table_for(s, T, R, P)
    rows[s] = {"num_shapes": bp.num_shapes(t), **bp.padding(t, shapes, cost)}
  rows["exact"] = {"num_shapes": len(set(bp.select_for(bp.table_for("exact", T, R, P), x)
                                         for x in shapes)),
                   **bp.padding(bp.table_for("exact", T, R, P), shapes, cost)}
  print(f"trace {FLAGS.trace}: {len(trace)} requests -> {len(shapes)} steps "
        f"(policy {FLAGS.policy}, {T} tokens x {R} requests per step)")
  print(f"fitted table (<= {FLAGS.max_shapes} shapes): {strict_json.dumps(table.to_json())}")
  unit = "rows" if FLAGS.cost == "rows" else "ms"
  scale = 1.0 if FLAGS.cost == "rows" else 1e3
  print(f"\n{'strategy':>8} {'shapes':>7} {'pad tokens':>11} {'pad slots':>10} "
        f"{'pad Q rows':>11} {'mean T':>7} {'step ' + unit:>9}")
  for name, r in rows.items():
    print(f"{name:>8} {r['num_shapes']:>7} {100 * r['padded_token_frac']:>10.1f}% "
          f"{100 * r['padded_slot_frac']:>9.1f}% {100 * r['padded_query_row_frac']:>10.1f}% "
          f"{r['mean_bucket_tokens']:>7.1f} {scale * r['mean_step_cost']:>9.2f}")
  print(f"(step {unit}: the mean step's cost under --cost={FLAGS.cost}, padding only)")
  print("(exact: the distinct shapes this trace ran, each its own executable)")
  if FLAGS.output:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
    with open(FLAGS.output, "w") as f:
      strict_json.dump({"table": table.to_json(), "trace": FLAGS.trace,
                        "steps": len(shapes), "cost": FLAGS.cost, "strategies": rows,
                        "search": {"combinations_tried": info["combinations_tried"]}}, f,
                       indent=1)
    print(f"wrote {FLAGS.output}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
