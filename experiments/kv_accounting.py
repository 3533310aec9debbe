"""KV reservation accounting for the three policies of chapter 8.3.1 / 8.3.2.

  python -m experiments.kv_accounting --lengths=9,13,5,15 --max_len=16 --page_size=4 --share=A,B,8
  python -m experiments.kv_accounting --branches=4 --prefix_pages=95 --private_pages=9 \
      --page_size=16
  python -m experiments.kv_accounting --layer_windows=64 --prompt_len=512 --page_size=16
  python -m experiments.kv_accounting --layer_windows=64,0 --prompt_len=512 --page_size=16

Sliding windows (--layer_windows, a pattern repeated over the layers; 0: full attention):
one request runs through the engine's page manager, prefill in chunks of --step_tokens,
then decode, releasing the pages wholly behind each window after every step; where
windows mix, the layers are grouped with page tables per group (kv.grouped_layout), as
the engine keeps them. Printed per window: the most pages one group held between decode
steps and during any step, beside the arithmetic (accounting.pages_held,
step_pages_bound) and full attention.
"""
from __future__ import annotations

import dataclasses
import string

from absl import app, flags

from jaxinfer.costmodel import accounting
from jaxinfer.kv import grouped_layout
from jaxinfer.runtime.pages import HOLE, page_manager
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["9", "13", "5", "15"], "sequence lengths (named A, B, C, ...)")
flags.DEFINE_integer("max_len", 16, "maximum length (whole-segment reservation)")
flags.DEFINE_integer("page_size", 4, "tokens per page")
flags.DEFINE_multi_string("share", [], "X,Y,N: sequences X and Y share their first N tokens")
flags.DEFINE_integer("branches", 0, "branching example: number of branches")
flags.DEFINE_integer("prefix_pages", 95, "branching example: shared prefix pages")
flags.DEFINE_integer("private_pages", 9, "branching example: private pages per branch")
flags.DEFINE_list("layer_windows", [], "sliding windows: each layer's window in a pattern "
                  "repeated over the layers (0: full attention), e.g. 64 (Mistral-style) or "
                  "64,0 (Gemma-2-style)")
flags.DEFINE_integer("num_layers", 0, "sliding windows: layers (0: the pattern's length)")
flags.DEFINE_integer("prompt_len", 512, "sliding windows: prompt tokens")
flags.DEFINE_integer("output_len", 128, "sliding windows: output tokens")
flags.DEFINE_integer("step_tokens", 256, "sliding windows: prefill chunk (new tokens per step)")
flags.DEFINE_bool("json", False, "emit JSON")


def _parse_share(s: str, names):
  x, y, n = s.split(",")
  try:
    return names.index(x.strip()), names.index(y.strip()), int(n)
  except ValueError:
    raise app.UsageError(f"--share={s!r}: expected X,Y,N with X, Y among {names}") from None


def window_groups(windows, prompt_len: int, output_len: int, step_tokens: int,
                  page_size: int) -> list:
  """One row per window in `windows` (each layer's, 0: full): one request run through the
  engine's page manager for that layer pattern (kv.grouped_layout: one page table per
  layer group where windows mix, else one), chunked prefill then decode (K/V of
  L + G - 1 tokens), the pages behind each window released after every step; the most
  pages one group of that window held between decode steps and during any step, beside
  the arithmetic."""
  layout = grouped_layout(tuple(windows))
  end = prompt_len + output_len - 1
  full = accounting.pages_for(end, page_size)
  pm = page_manager(full * layout.num_groups + 1, page_size, layout.windows)
  pm.add_sequence("r")
  tables = ((lambda: pm.page_table("r")) if layout.num_groups > 1
            else (lambda: (pm.page_table("r"),)))
  step_most = [0] * layout.num_groups
  decode_most = [0] * layout.num_groups
  tokens = 0
  while tokens < end:
    n = min(step_tokens, prompt_len - tokens) if tokens < prompt_len else 1
    assert pm.grow("r", tokens + n) is not None
    live = [sum(p != HOLE for p in t) for t in tables()]
    step_most = [max(a, b) for a, b in zip(step_most, live)]
    tokens += n
    pm.slide("r", tokens, layout.windows[0] if layout.num_groups == 1 else 0)
    if tokens >= prompt_len:
      live = [sum(p != HOLE for p in t) for t in tables()]
      decode_most = [max(a, b) for a, b in zip(decode_most, live)]
  pm.check_invariants()
  rows = []
  for w in sorted(set(windows), reverse=True):
    g = layout.windows.index(w)  # the first group of this window (they run alike)
    rows.append({"window": w, "layers": list(windows).count(w),
                 "groups": layout.windows.count(w),
                 "pages_held_in_decode": decode_most[g],
                 "pages_held_in_a_step": step_most[g],
                 "formula_held": max(accounting.pages_held(t, page_size, w)
                                     for t in range(prompt_len, end + 1)),
                 "formula_step": (min(accounting.step_pages_bound(w, step_tokens, page_size),
                                      full) if w else full),
                 "full_attention_pages": full})
  return rows


def _main_windows():
  pattern = [int(x) for x in FLAGS.layer_windows]
  if any(w < 0 for w in pattern) or not pattern:
    raise app.UsageError(f"--layer_windows must be integers >= 0, got {FLAGS.layer_windows}")
  for name in ("prompt_len", "output_len", "step_tokens", "page_size"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  L = FLAGS.num_layers or len(pattern)
  windows = [pattern[i % len(pattern)] for i in range(L)]
  rows = window_groups(windows, FLAGS.prompt_len, FLAGS.output_len, FLAGS.step_tokens,
                       FLAGS.page_size)
  for r in rows:  # the engine's manager released them above (one table or one per group)
    r["engine_releases"] = bool(r["window"])
  total_layers = len(windows)
  held = sum(r["pages_held_in_decode"] * r["layers"] for r in rows) / total_layers
  full = rows[0]["full_attention_pages"]
  out = {"layer_windows": windows, "page_size": FLAGS.page_size,
         "prompt_len": FLAGS.prompt_len, "output_len": FLAGS.output_len,
         "step_tokens": FLAGS.step_tokens, "groups": rows,
         "kv_held_in_decode_vs_full_attention": held / full}
  if FLAGS.json:
    print(strict_json.dumps(out, indent=1))
    return
  cols = ["window", "layers", "groups", "pages_held_in_decode", "formula_held",
          "pages_held_in_a_step", "formula_step", "full_attention_pages", "engine_releases"]
  print(" ".join(f"{c:>21}" for c in cols))
  for r in rows:
    print(" ".join(f"{str(r[c]):>21}" for c in cols))
  print(f"KV held in decode, all layers: {held:.1f} of {full} page-layers per layer "
        f"({100 * held / full:.0f}% of full attention)")


def main(argv):
  del argv
  if FLAGS.layer_windows:
    return _main_windows()
  if FLAGS.branches:
    rows = accounting.account_branches(FLAGS.branches, FLAGS.prefix_pages, FLAGS.private_pages,
                                       FLAGS.page_size)
  else:
    lengths = [int(x) for x in FLAGS.lengths]
    names = list(string.ascii_uppercase[:len(lengths)])
    shares = [_parse_share(s, names) for s in FLAGS.share]
    rows = accounting.account(lengths, FLAGS.max_len, FLAGS.page_size, shares)
  if FLAGS.json:
    print(strict_json.dumps([dict(dataclasses.asdict(r), stored_tokens=r.stored_tokens)
                             for r in rows], indent=1))
    return
  cols = ["policy", "stored_tokens", "reserved_slots", "allocated_slots", "unused_slots",
          "page_table_entries", "physical_pages"]
  print(" ".join(f"{c:>18}" for c in cols))
  for r in rows:
    print(" ".join(f"{getattr(r, c):>18}" for c in cols))


if __name__ == "__main__":
  app.run(main)
