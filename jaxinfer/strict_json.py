"""Strict JSON for everything the project prints or writes: no NaN / Infinity tokens
(RFC 8259 has none; `json.loads` accepts them, most other parsers do not).

A non-finite float becomes null, so a figure that has no finite value (an infeasible
configuration's time, a rate over zero seconds) reads as "no value". NumPy scalars and
arrays become plain numbers and lists.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def finite(obj: Any) -> Any:
  """A copy of obj with every non-finite float replaced by None (recursively)."""
  if isinstance(obj, (float, np.floating)):
    v = float(obj)
    return v if math.isfinite(v) else None
  if isinstance(obj, np.integer):
    return int(obj)
  if isinstance(obj, np.ndarray):
    return finite(obj.tolist())
  if isinstance(obj, dict):
    return {k: finite(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [finite(v) for v in obj]
  return obj


def dumps(obj: Any, **kw) -> str:
  return json.dumps(finite(obj), allow_nan=False, **kw)


def dump(obj: Any, f, **kw) -> None:
  json.dump(finite(obj), f, allow_nan=False, **kw)
