"""KV reservation accounting for the three policies of chapter 8.3.1 / 8.3.2.

  python -m experiments.kv_accounting --lengths=9,13,5,15 --max_len=16 --page_size=4 --share=A,B,8
  python -m experiments.kv_accounting --branches=4 --prefix_pages=95 --private_pages=9 \
      --page_size=16
"""
from __future__ import annotations

import dataclasses
import string

from absl import app, flags

from jaxinfer.costmodel import accounting
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["9", "13", "5", "15"], "sequence lengths (named A, B, C, ...)")
flags.DEFINE_integer("max_len", 16, "maximum length (whole-segment reservation)")
flags.DEFINE_integer("page_size", 4, "tokens per page")
flags.DEFINE_multi_string("share", [], "X,Y,N: sequences X and Y share their first N tokens")
flags.DEFINE_integer("branches", 0, "branching example: number of branches")
flags.DEFINE_integer("prefix_pages", 95, "branching example: shared prefix pages")
flags.DEFINE_integer("private_pages", 9, "branching example: private pages per branch")
flags.DEFINE_bool("json", False, "emit JSON")


def _parse_share(s: str, names):
  x, y, n = s.split(",")
  try:
    return names.index(x.strip()), names.index(y.strip()), int(n)
  except ValueError:
    raise app.UsageError(f"--share={s!r}: expected X,Y,N with X, Y among {names}") from None


def main(argv):
  del argv
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
