"""experiments.chapter: the chapter's worked figures computed by the library agree with
the chapter's, and every one of them moves when an input it rests on moves (none is a
constant)."""
import functools
import json
import os
import subprocess
import sys

import pytest

from experiments import chapter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(part, **changes):
  c = chapter.load_config(part)
  if part == "8.3":
    c.inputs.cpu_cancel = False  # loads the real model: the binary's run measures it
  for k, v in changes.items():
    c.inputs[k] = v
  return c


def _figures(part, **changes):
  if not changes:
    return _unchanged(part)
  return {f.key: f for f in chapter.compute_part(part, config=_config(part, **changes))}


@functools.lru_cache(maxsize=None)
def _unchanged(part):
  """A part's figures from its own inputs (computed once: the tests only read them)."""
  return {f.key: f for f in chapter.compute_part(part, config=_config(part))}


@pytest.fixture(scope="module")
def every_figure():
  return [f for p in chapter.PARTS for f in _figures(p).values()]


def test_the_chapter_agrees(every_figure):
  """At least 95% of the worked figures within 2%; none missing; every one beyond 2% has
  its reason; every computed figure names what computed it."""
  s = chapter.summary(every_figure)
  t = s["total"]
  assert t["worked"] >= 240 and t["missing"] == 0
  assert t["share_within_2pct"] >= 0.95, s["beyond_2pct"]
  assert all(r["reason"] != "unexplained" for r in s["beyond_2pct"]), s["beyond_2pct"]
  assert set(s["parts"]) == set(chapter.PARTS)
  for f in every_figure:
    assert f.kind in ("worked", "gpu", "quoted", "computed"), f
    if f.value is not None:
      assert f.source, f.key
  worked = [f for f in every_figure if f.kind == "worked"]
  assert len({f.section for f in worked}) >= 20  # every section with a worked example
  # the simulator's analogues of GPU measurements are there beside them
  gpu = {f.key: f for f in every_figure if f.kind == "gpu"}
  assert gpu["sweep_throughput_b64"].value and gpu["continuous_goodput_rate4"].value


# One input per section with worked figures: (part, input, new value, figure, the figure's
# value after the change). Expected values are worked by hand from the chapter's formulas.
MOVES = [
    ("8.1", "queue_s", 0.2, "request_time_s_811", 7.0535),  # 8.1.1
    ("8.1", "kv_budget_gib", 6.0, "long_fit", 5),  # 8.1.2: floor(6144 / 1188)
    ("8.1", "round_b16_s", 0.032, "throughput_b16", 500),  # 8.1.3
    ("8.2", "contexts", (4096, 8192), "b_kv_2k", 26),  # 8.2.1: ceil(D_w / (4096 k))
    ("8.2", "fixed_ms", 36.22, "affine_decode_round_ms", 36.2565),  # 8.2.2
    ("8.2", "pair_chunk", 256, "pairs_first_chunk", 32896),  # 8.2.3
    ("8.2", "graph_rows", (16, 24, 32), "graph_rows_for_17", 24),  # 8.2.4
    ("8.3", "page_size", 8, "paged_slots", 56),  # 8.3.1: 16 + 16 + 8 + 16
    ("8.3", "branches", 8, "branch_physical_pages", 167),  # 8.3.2
    ("8.3", "snapshot_interval", 2048, "recompute_tokens", 512),  # 8.3.3: 10752 - 10240
    ("8.3", "p_hit", 1.0, "prefix_a_value_ms", None),  # 8.3.4: moves
    ("8.4", "code_bits", 3, "q2k_code_bytes", 96),  # 8.4.1
    ("8.4", "read_mbu", 1.3, "effective_bandwidth_tbs", 2.3296),  # 8.4.2
    ("8.4", "offload_every", 2, "offloaded_sets", 18),  # 8.4.3
    ("8.5", "target", (0.5, 0.5), "accept_a", 0.5),  # 8.5.1
    ("8.5", "draft_len", 2, "expected_tokens_bbbb", 2.3125),  # 8.5.2
    ("8.5", "draft_tokens", 8, "sequential_draft_ms", None),  # 8.5.3: moves
    ("8.5", "verify_rows", (8, 12, 16), "verify_rows_for_9", 12),  # 8.5.4
    ("8.6", "arrival_rate", 8.0, "little_n_fast", 4),  # 8.6.1
    ("8.6", "measured_round_ms", 32.0, "r_decode", 500),  # 8.6.3
]


@pytest.mark.parametrize("part,name,value,key,expected", MOVES,
                         ids=[f"{m[0]}-{m[1]}" for m in MOVES])
def test_an_input_moves_its_figures(part, name, value, key, expected):
  before = _figures(part)[key].value
  after = _figures(part, **{name: value})[key].value
  assert after != pytest.approx(before), (key, before, after)
  if expected is not None:
    assert after == pytest.approx(expected, rel=1e-4)


def test_the_binary_writes_strict_json_and_a_page(tmp_path):
  r = subprocess.run([sys.executable, "-m", "experiments.chapter", "--section=8.1", "--json",
                      f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout)
  assert {f["section"] for f in out["figures"]} == {"8.1", "8.1.1", "8.1.2", "8.1.3"}
  assert out["summary"]["total"]["worked"] == len(out["figures"])
  page = (tmp_path / "chapter.md").read_text()
  assert "| 8.1.2 |" in page and "## Summary" in page
  assert json.loads((tmp_path / "chapter.json").read_text()) == out
  bad = subprocess.run([sys.executable, "-m", "experiments.chapter", "--section=9.1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0 and "9.1" in bad.stderr
