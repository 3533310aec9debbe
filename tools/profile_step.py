"""Where one step's time goes, per XLA op: a jax.profiler trace of a few steady steps,
summed by op family (an XLA fusion's name without its numeric suffix: every layer's
`ynn_fusion.7` and `ynn_fusion.9` count as `ynn_fusion`).

  python tools/profile_step.py --batch=16 --context=256
  python tools/profile_step.py --batch=1 --new_tokens=512 --context=0     # a prefill
  python tools/profile_step.py --batch=16 --layers=unrolled --output_dir=out/profile

On XLA:CPU the families are: the project's native calls by their targets
(`jaxinfer_f32_panel_matmul`, `jaxinfer_bf16_tile_matmul`, `jaxinfer_block_matmul`,
`jaxinfer_paged_decode`: the trace names each only `ffi_call.N`, so the binary has XLA dump
the optimized HLO to a temporary directory and reads the targets there), `ynn_fusion` /
`xnn_fusion` (matmuls and reductions through YNNPACK / XNNPACK), `dynamic-slice*_fusion`
(a scanned layer's weights copied out of the stacked arrays), `*gather_fusion` (KV pages
gathered for attention), `while` (a scanned layer loop, or the attention's page-block
loop: it holds the ops inside it), `copy` (buffers XLA could not update in place). Ops can
run on both cores at once, so their times may sum to more than the step's wall time.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
if __name__ == "__main__":
  flags.DEFINE_string("model", "smollm2-135m-instruct", "model name or GGUF path")
  flags.DEFINE_integer("batch", 16, "requests in the step")
  flags.DEFINE_integer("context", 256, "cached tokens per request")
  flags.DEFINE_integer("new_tokens", 1, "new tokens per request (1: decode; more: prefill)")
  flags.DEFINE_enum("attention", "xla", ["xla", "reference", "pallas"], "attention backend")
  flags.DEFINE_enum("layers", "scan", ["scan", "unrolled"], "layer loop: lax.scan over "
                    "stacked weights or one block per layer")
  flags.DEFINE_string("kv_format", "f32", "KV format")
  flags.DEFINE_enum("weight_format", "dense", ["dense", "gguf"], "dense f32 weights, or the "
                    "GGUF file's own blocks read in place (steps of few tokens)")
  flags.DEFINE_enum("gguf_activations", "q8", ["q8", "f32"], "gguf: the block products' "
                    "activations (8-bit as llama.cpp, or float32)")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dense weights' dtype "
                    "(bfloat16: bf16 x bf16 -> f32 matmuls, as bench_decode's bf16 rows)")
  flags.DEFINE_integer("steps", 3, "profiled steps (after 3 untimed ones)")
  flags.DEFINE_integer("top", 15, "op families printed")
  flags.DEFINE_string("output_dir", "", "write profile_step.json here")

# trace events that are not XLA ops: the runtime's own spans and Python frames
_NOT_OPS = ("$", "ThunkExecutor", "PjitFunction", "SlinkyThreadPool", "end: ",
            "CommonPjRtLoadedExecutable", "PjRt")


def custom_call_targets(dump_dir: str) -> dict:
  """{(HLO module, instruction): custom-call target} of every custom call in the optimized
  HLO that XLA dumped under dump_dir (--xla_dump_to): the trace names an FFI call only
  `ffi_call.N`."""
  out = {}
  for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
    module = None
    with open(path) as f:
      for line in f:
        if line.startswith("HloModule "):
          module = line.split()[1].rstrip(",")
        m = re.search(r'%(\S+) = .*custom_call_target="([^"]+)"', line)
        if m:
          out[module, m.group(1)] = m.group(2)
  return out


def op_families(trace_events, steps: int, targets: dict | None = None):
  """{family: (ms per step, ops per step)} from a Chrome-format trace's complete events; a
  custom call found in `targets` counts under its target's name."""
  total = collections.Counter()
  count = collections.Counter()
  for e in trace_events:
    if e.get("ph") != "X" or e.get("name", "").startswith(_NOT_OPS):
      continue
    target = (targets or {}).get((e.get("args", {}).get("hlo_module"), e["name"]))
    fam = target or re.sub(r"\.\d+$", "", e["name"])
    total[fam] += e.get("dur", 0)
    count[fam] += 1
  return {k: (v / steps / 1e3, count[k] / steps) for k, v in total.most_common()}


def main(argv):
  del argv
  # the optimized HLO, to name each FFI call by its target (custom_call_targets); set
  # before jax starts its backend. A dump the caller asked for (--xla_dump_to in XLA_FLAGS)
  # is read where it is and kept.
  xla_flags = os.environ.get("XLA_FLAGS", "")
  theirs = re.search(r"--xla_dump_to=(\S+)", xla_flags)
  dump = theirs.group(1) if theirs else tempfile.mkdtemp(prefix="profile_step_hlo_")
  as_text = "" if "--xla_dump_hlo_as_text" in xla_flags else " --xla_dump_hlo_as_text"
  os.environ["XLA_FLAGS"] = (xla_flags + ("" if theirs else f" --xla_dump_to={dump}") +
                             as_text).strip()
  try:
    _profile(dump)
  finally:
    if not theirs:
      shutil.rmtree(dump, ignore_errors=True)


def _profile(dump: str):
  import jax
  from jaxinfer import benchmarking as bm
  from jaxinfer.executors.jax_executor import JaxExecutor
  from jaxinfer.loading import load_model
  from jaxinfer.model.params import unstack_layers
  for name in ("batch", "new_tokens", "steps", "top"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  if FLAGS.context < 0:
    raise app.UsageError(f"--context must be >= 0, got {FLAGS.context}")
  m = load_model(FLAGS.model, FLAGS.dtype, weight_format=FLAGS.weight_format)
  params = m.params
  if FLAGS.layers == "unrolled":  # own buffers per layer (slices of the stack would alias)
    params = jax.tree_util.tree_map(jax.numpy.array, unstack_layers(params))
  step, pages = bm.uniform_step(FLAGS.batch, FLAGS.context, FLAGS.new_tokens, 16)
  ex = JaxExecutor(m.cfg, params, num_pages=pages, page_size=16, kv_format=FLAGS.kv_format,
                   backend=FLAGS.attention, gguf_activations=FLAGS.gguf_activations)
  wall = bm.time_step(ex, step, max(FLAGS.steps, 3))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(FLAGS.steps):
        ex.execute(step)
    files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    if not files:
      raise RuntimeError(f"jax.profiler wrote no trace under {d}")
    with gzip.open(files[0]) as f:
      events = json.load(f)["traceEvents"]
  fams = op_families(events, FLAGS.steps, custom_call_targets(dump))
  op_ms = sum(ms for ms, _ in fams.values())
  kind = "decode" if FLAGS.new_tokens == 1 else f"{FLAGS.new_tokens}-token prefill"
  print(f"{FLAGS.model}, {kind}, batch {FLAGS.batch}, context {FLAGS.context}, attention "
        f"{FLAGS.attention}, layers {FLAGS.layers}, weights {FLAGS.weight_format} "
        f"{FLAGS.dtype} "
        f"({jax.default_backend()}, jax "
        f"{jax.__version__}): step {1e3 * wall:.1f} ms wall, {op_ms:.1f} ms summed over ops")
  print(f"{'op family':<44} {'ms/step':>8} {'ops/step':>8} {'share':>6}")
  for fam, (ms, n) in list(fams.items())[:FLAGS.top]:
    print(f"{fam[:44]:<44} {ms:>8.2f} {n:>8.0f} {ms / op_ms:>6.1%}")
  if FLAGS.output_dir:
    from jaxinfer import strict_json
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    out = {"model": FLAGS.model, "batch": FLAGS.batch, "context": FLAGS.context,
           "new_tokens": FLAGS.new_tokens, "attention": FLAGS.attention,
           "layers": FLAGS.layers, "weight_format": FLAGS.weight_format,
           "dtype": FLAGS.dtype,
           "step_ms": 1e3 * wall, "op_ms": op_ms,
           "families": [{"family": k, "ms_per_step": ms, "ops_per_step": n}
                        for k, (ms, n) in fams.items()],
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(os.path.join(FLAGS.output_dir, "profile_step.json"), "w") as f:
      strict_json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
