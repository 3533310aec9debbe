"""Writes docs/cli.md from the absl flags of `python -m jaxinfer` (jaxinfer/cli.py), so
the page is never a hand copy: `tests/test_docs.py` regenerates it and fails when the
committed page differs.

  python tools/gen_cli_docs.py [--output=docs/cli.md]
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HEAD = """# Command line

Generated from the flags of `jaxinfer/cli.py` and the engine options it defines from
`EngineConfig` (`jaxinfer/engine_config.py`) by `python tools/gen_cli_docs.py`; `python -m
jaxinfer --help` prints the same text.

```
{usage}
```

Bad arguments are one line on stderr and exit code 2, before the model loads.

| flag | type | default | meaning |
|---|---|---|---|
"""


def _cell(text: str) -> str:
  return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
  from absl import flags
  from jaxinfer import cli, engine_config
  rows = []
  every = [f for m in (cli, engine_config) for f in flags.FLAGS.get_flags_for_module(m.__name__)]
  for f in sorted(every, key=lambda f: f.name):
    kind = f.flag_type()
    if getattr(f.parser, "enum_values", None):
      kind = "one of " + ", ".join(f.parser.enum_values)
    default = f.default_as_str.strip("'") if f.default is not None else "-"
    rows.append(f"| `--{f.name}` | {_cell(kind)} | {_cell(default)} | {_cell(f.help)} |")
  return HEAD.format(usage=cli.USAGE) + "\n".join(rows) + "\n"


def main(argv):
  out = os.path.join(ROOT, "docs", "cli.md")
  for a in argv[1:]:
    if a.startswith("--output="):
      out = a.split("=", 1)[1]
    else:
      print(f"error: unknown argument {a!r} (--output=PATH)", file=sys.stderr)
      return 2
  with open(out, "w") as fh:
    fh.write(render())
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
