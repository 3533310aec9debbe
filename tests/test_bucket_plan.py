"""Bucket strategies and the trace-fitted table (jaxinfer/bucket_plan.py and
tools/bucket_plan.py), and the simulator's padding / compile charges."""
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxinfer import bucket_plan as bp
from jaxinfer.buckets import BucketTable

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "configs" / "traces" / "chat_synthetic.jsonl"


def _brute_force(values, k, hi):
  cands = sorted(set(values) | {hi})
  best = None
  for r in range(1, k + 1):
    for combo in itertools.combinations(cands, r):
      if combo[-1] != hi:
        continue
      cost = sum(min(s for s in combo if s >= v) for v in values)
      best = cost if best is None else min(best, cost)
  return best


@pytest.mark.parametrize("seed", range(6))
def test_fit_sizes_is_optimal(seed):
  rng = np.random.default_rng(seed)
  hi = 40
  values = rng.integers(1, hi + 1, size=int(rng.integers(3, 15))).tolist()
  for k in (1, 2, 3, 4):
    sizes = bp.fit_sizes(values, k, hi)
    assert len(sizes) <= k and sizes[-1] == hi
    cost = sum(min(s for s in sizes if s >= v) for v in values)
    assert cost == _brute_force(values, k, hi), (values, k, sizes)


def test_ladders():
  assert bp.ladder("pow2", 16, 100) == (16, 32, 64, 100)
  assert bp.ladder("pow4", 1, 64) == (1, 4, 16, 64)
  assert bp.ladder("linear", 1, 256, 4) == (64, 128, 192, 256)
  assert bp.ladder("exact", 1, 5) == (1, 2, 3, 4, 5)
  with pytest.raises(ValueError, match="strategy must be one of"):
    bp.ladder("fibonacci", 1, 5)


@pytest.fixture(scope="module")
def chat_shapes():
  trace = bp.load_trace(str(TRACE))[:80]
  return bp.trace_step_shapes(trace, 128, 32)


def test_fitted_table_covers_the_trace_under_the_cap_and_pads_less(chat_shapes):
  pow4 = bp.table_for("pow4", 128, 32, 64)
  cap = bp.num_shapes(pow4)
  table, info = bp.fit_table(chat_shapes, cap, 128, 32, 64, max_sizes=4)
  assert info["num_shapes"] == bp.num_shapes(table) <= cap
  for s in chat_shapes:  # every step of the trace has a bucket that holds it
    b = bp.select_for(table, s)
    assert b.num_tokens >= s.n and b.num_requests >= s.d + s.p
  # with the same budget of executables the fitted table costs less than the powers-of-
  # four ladder on the trace it was fitted to, under either objective
  assert info["mean_step_cost"] < bp.padding(pow4, chat_shapes)["mean_step_cost"]
  cost = bp.roofline_cost("smollm2-135m-instruct@local-cpu")
  timed, tinfo = bp.fit_table(chat_shapes, cap, 128, 32, 64, max_sizes=4, cost=cost)
  assert tinfo["num_shapes"] <= cap
  assert tinfo["mean_step_cost"] < bp.padding(pow4, chat_shapes, cost)["mean_step_cost"]
  with pytest.raises(ValueError, match="raise max_shapes"):
    bp.fit_table(chat_shapes, 1, 128, 32, 64, max_sizes=2)


def test_trace_validation(tmp_path):
  bad = tmp_path / "t.jsonl"
  bad.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 0}\n')
  with pytest.raises(ValueError, match="output_tokens must be an integer >= 1, got 0"):
    bp.load_trace(str(bad))
  bad.write_text('[5, 3]\n')
  with pytest.raises(ValueError, match="each line must be a JSON object, got list"):
    bp.load_trace(str(bad))


def test_bucket_table_json_is_validated(tmp_path):
  f = tmp_path / "t.json"
  for text, words in [("[16, 4]", "must be a JSON object, got list"),
                      ('{"token_sizes": 16, "request_sizes": [4], "page_table_sizes": [8]}',
                       "token_sizes must be a list of integers, got 16"),
                      ('{"token_sizes": [16], "request_sizes": [4]}', "misses"),
                      ('{"table": {"token_sizes": [16], "request_sizes": [4], '
                       '"page_table_sizes": [0]}}', "page_table_sizes must be positive")]:
    f.write_text(text)
    with pytest.raises(ValueError, match=words):
      BucketTable.from_json(str(f))
  t = BucketTable.default(64, 4, 8)
  f.write_text(json.dumps({"table": t.to_json(), "steps": 3}))
  assert BucketTable.from_json(str(f)) == t


def test_simulator_charges_padding_and_first_use_compiles(chat_shapes):
  """The virtual clock pays for padded tokens and for each new shape's compile only when
  asked; the number of compiles is the number of distinct buckets the run used. (All
  requests arrive at once, so the three runs schedule the same steps.)"""
  from jaxinfer.config import SamplingParams
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  trace = bp.load_trace(str(TRACE))[:40]

  def run(**kw):
    ex = SimExecutor(AffineStepModel(), num_pages=4096, page_size=16, token_id=1, **kw)
    eng = Engine(ex, SchedulerConfig(max_running=32, token_budget=128, chunk_size=128),
                 buckets=BucketTable.default(128, 32, 128), max_model_len=2048)
    for i, r in enumerate(trace):
      eng.add_request([2] * r["prompt_tokens"], SamplingParams(
          max_tokens=r["output_tokens"], ignore_eos=True), arrival_time=0.0)
    eng.run()
    return ex, eng, max(s.start + s.duration for s in eng.steps)

  ex0, eng0, t0 = run()
  ex1, eng1, t1 = run(pad_to_buckets=True)
  ex2, eng2, t2 = run(compile_s=2.0)
  assert [s.members for s in eng1.steps] == [s.members for s in eng0.steps]
  padded = [s for s in eng0.steps if s.padded_tokens]
  assert padded and t1 > t0
  for a, b in zip(eng0.steps, eng1.steps):  # only steps with padding cost more
    # (durations are differences of virtual clock times: equal up to rounding)
    assert (b.duration > a.duration + 1e-9) == bool(a.padded_tokens)
  assert ex2.compiles == len({s.bucket for s in eng2.steps}) > 1
  assert sum(s.duration for s in eng2.steps) == pytest.approx(
      sum(s.duration for s in eng0.steps) + 2.0 * ex2.compiles, rel=1e-3)


def test_bucket_plan_tool_writes_a_table_the_engine_reads(tmp_path):
  out = tmp_path / "plan.json"
  r = subprocess.run([sys.executable, "tools/bucket_plan.py", f"--trace={TRACE}",
                      "--max_shapes=20", "--max_num_batched_tokens=64", "--max_num_seqs=8",
                      "--max_model_len=2048", "--max_sizes=3", f"--output={out}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  d = json.loads(out.read_text())
  table = BucketTable.from_json(str(out))
  assert d["strategies"]["fitted"]["num_shapes"] == bp.num_shapes(table) <= 20
  assert table.max_tokens == 64 and table.max_requests == 8 and table.max_pages == 128
  assert "fitted" in r.stdout and "pow4" in r.stdout
  bad = tmp_path / "bad.json"
  bad.write_text('{"token_sizes": [16], "request_sizes": [4], "page_table_sizes": [8], "tiers": 2}')
  r = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", f"--buckets={bad}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "unknown bucket table fields ['tiers']" in r.stderr
