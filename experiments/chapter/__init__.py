"""The chapter's worked figures, computed by the library beside the values the chapter states.

  python -m experiments.chapter [--section=8.3.4] [--json] [--output_dir=DIR]

Each part of the chapter (8.1 ... 8.6) is a module here whose `compute(inputs)` returns
the figures the library computes from that part's inputs, and a config file in
configs/chapter/ holding the inputs and, apart, what the chapter states for each figure.
A stated value is only ever the comparison column: every computed value goes through the
library's formulas, planner or simulator, so changing an input moves the figures that
rest on it.

What the chapter states falls in three kinds:
- worked: a figure the chapter derives from its inputs; the library must reproduce it
  (these make the summary's denominator);
- gpu: a measurement on the chapter's GPU (a latency, a hit count, a quality score); shown
  with the nearest thing the library computes (a simulation on the chapter's cost model)
  where there is one, and left out of the denominator;
- quoted: a figure the chapter quotes from another chapter or report as it is (nothing to
  derive).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
from typing import Dict, Iterable, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "configs", "chapter")
PARTS = ("8.1", "8.2", "8.3", "8.4", "8.5", "8.6")
KINDS = ("worked", "gpu", "quoted")
AGREE = 0.02  # within 2%: the summary's first column
CLOSE = 0.10


@dataclasses.dataclass
class Figure:
  """One figure: what the library computes and, where the chapter states it, the stated
  value (kept as the chapter prints it, so its rounding is known)."""
  section: str  # "8.3.4", or an exercise: "ex8-4"
  key: str
  what: str
  value: Optional[float]  # computed by the library (None: nothing computes it)
  unit: str = ""
  source: str = ""  # the function, planner command or study that computed it
  stated: Optional[str] = None
  kind: str = "computed"  # worked | gpu | quoted; computed: no stated value to compare
  reason: str = ""  # why it differs from the stated value by more than 2%

  @property
  def stated_value(self) -> Optional[float]:
    return None if self.stated is None else float(self.stated.lstrip("<"))

  @property
  def rel_diff(self) -> Optional[float]:
    """(computed - stated) / |stated|; None when either is missing."""
    s = self.stated_value
    if s is None or self.value is None:
      return None
    if s == 0:
      return abs(self.value)
    return (self.value - s) / abs(s)

  @property
  def rounds_to_stated(self) -> bool:
    """The computed value, rounded to the digits the chapter prints, is the stated one."""
    if self.stated is None or self.value is None:
      return False
    text = self.stated.lstrip("<")
    places = len(text.split(".")[1]) if "." in text else 0
    return round(self.value, places) == round(float(text), places)

  @property
  def band(self) -> str:
    """within_2pct | within_10pct | beyond | missing (worked figures only)."""
    d = self.rel_diff
    if d is None:
      return "missing"
    if self.stated.startswith("<"):
      return "within_2pct" if self.value < self.stated_value else "beyond"
    d = abs(d)
    return "within_2pct" if d <= AGREE else "within_10pct" if d <= CLOSE else "beyond"

  def to_json(self) -> Dict:
    out = dataclasses.asdict(self)
    out.update(stated_value=self.stated_value, rel_diff=self.rel_diff,
               band=self.band if self.kind == "worked" else None)
    return out


def fig(section: str, key: str, what: str, value, unit: str = "", source: str = "") -> Figure:
  """A computed figure (a compute function's building block)."""
  return Figure(section, key, what, None if value is None else float(value), unit, source)


def load_config(part: str, config_dir: str = CONFIG_DIR):
  """The part's config (configs/chapter/s8_1.py for 8.1): get_config()'s inputs (a
  ConfigDict) and the stated tuples."""
  path = os.path.join(config_dir, f"s{part.replace('.', '_')}.py")
  spec = importlib.util.spec_from_file_location(f"chapter_config_{part.replace('.', '_')}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def join(computed: Sequence[Figure], config) -> List[Figure]:
  """Attach the chapter's stated values to the computed figures.

  config.stated: (section, key, value as printed, kind[, reason]) tuples. A stated figure
  no computation produced is kept, with value None (a worked one counts as missing)."""
  by_key = {}
  for f in computed:
    if f.key in by_key:
      raise ValueError(f"figure {f.key!r} computed twice")
    by_key[f.key] = f
  out, seen = [], set()
  for row in config.stated:
    section, key, stated, kind = row[:4]
    if kind not in KINDS:
      raise ValueError(f"stated figure {key!r}: kind must be one of {KINDS}, got {kind!r}")
    if key in seen:
      raise ValueError(f"figure {key!r} stated twice")
    seen.add(key)
    f = by_key.get(key) or Figure(section, key, "", None)
    f.section, f.stated, f.kind = section, str(stated), kind
    f.reason = row[4] if len(row) > 4 else ""
    if f.kind == "worked" and f.band != "within_2pct" and not f.reason and f.rounds_to_stated:
      f.reason = "the chapter prints the computed value rounded"
    out.append(f)
  out += [f for f in computed if f.key not in seen]
  return out


def compute_part(part: str, config_dir: str = CONFIG_DIR, config=None) -> List[Figure]:
  config = config if config is not None else load_config(part, config_dir)
  mod = importlib.import_module(f"experiments.chapter.s{part.replace('.', '_')}")
  return join(mod.compute(config.inputs), config)


def select(figures: Iterable[Figure], section: str) -> List[Figure]:
  """Figures of a section ("8.3" or "8.3.4") and of its exercises."""
  if not section:
    return list(figures)
  part = section.split(".")[:2]
  exercise = f"ex{part[0]}-" if len(part) == 1 else None
  return [f for f in figures if f.section == section or f.section.startswith(section + ".")
          or (exercise and f.section.startswith(exercise))]


def summary(figures: Sequence[Figure]) -> Dict:
  """Counts of the worked figures within 2%, within 10% and beyond (missing ones beyond),
  per part and overall, and every worked figure beyond 2% with its reason."""
  def counts(fs):
    worked = [f for f in fs if f.kind == "worked"]
    c = {b: sum(f.band == b for f in worked)
         for b in ("within_2pct", "within_10pct", "beyond", "missing")}
    c["worked"] = len(worked)
    c["share_within_2pct"] = c["within_2pct"] / len(worked) if worked else math.nan
    c["gpu"] = sum(f.kind == "gpu" for f in fs)
    c["quoted"] = sum(f.kind == "quoted" for f in fs)
    c["computed_only"] = sum(f.kind == "computed" for f in fs)
    return c
  parts = {p: counts([f for f in figures if part_of(f.section) == p]) for p in PARTS}
  off = [{"section": f.section, "key": f.key, "computed": f.value, "stated": f.stated,
          "rel_diff": f.rel_diff, "reason": f.reason or "unexplained"}
         for f in figures if f.kind == "worked" and f.band != "within_2pct"]
  return {"parts": {p: c for p, c in parts.items() if c["worked"] or c["gpu"]},
          "total": counts(figures), "beyond_2pct": off}


def part_of(section: str) -> str:
  if section.startswith("ex"):
    return section[2:].split("-")[0] + "." + _EXERCISE_PART[section]
  return ".".join(section.split(".")[:2])


# which part of the chapter each exercise belongs to
_EXERCISE_PART = {"ex8-1": "2", "ex8-2": "2", "ex8-3": "3", "ex8-4": "3", "ex8-5": "4",
                  "ex8-6": "4", "ex8-7": "5", "ex8-8": "6", "ex8-9": "6"}
