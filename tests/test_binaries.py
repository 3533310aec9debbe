"""The study binaries run from their commands and emit what they promise."""
import json
import subprocess
import sys

import pytest


def _run(*args, timeout=900):
  out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                       check=True, timeout=timeout)
  return out.stdout


def test_plan_select_json(tmp_path):
  d = json.loads(_run("experiments.plan", "select", "--json", f"--output_dir={tmp_path}"))
  assert d["chosen"] == "D"
  assert {v["name"] for v in d["variants"]} == set("ABCDE")
  assert (tmp_path / "plan_select.png").stat().st_size > 10_000


def test_scheduling_sim_json(tmp_path):
  d = json.loads(_run("experiments.scheduling", "--workload=ch8_2_2", "--policy=all",
                      "--executor=sim", "--json", f"--output_dir={tmp_path}"))
  assert d["continuous"]["max_itl_ms"] > d["chunked"]["max_itl_ms"] > d["fixed"]["max_itl_ms"]
  assert (tmp_path / "scheduling_sim_chunked.png").exists()


@pytest.mark.slow
def test_speculative_small(tmp_path):
  out = _run("experiments.speculative", "--small", f"--output_dir={tmp_path}")
  assert "tok/round" in out
  d = json.loads((tmp_path / "speculative.json").read_text())
  assert {r["drafter"] for r in d["real"]} == {"none", "ngram", "early_exit"}


def test_batch_sweep_simulation_matches_chapter():
  """Simulated 8-1 sweep (Qwen3-8B, RTX PRO 6000, roofline, chunked prefill) against the
  chapter's measured batch-1 and batch-64 points."""
  from experiments import batch_sweep
  rows = {r["batch"]: r for r in batch_sweep.sim_sweep([1, 64])}
  for b, (tok_s, ttft, itl_ms) in batch_sweep.CHAPTER.items():
    assert rows[b]["throughput_tok_s"] == pytest.approx(tok_s, rel=0.1)
    assert rows[b]["ttft_s"] == pytest.approx(ttft, rel=0.1)
    assert rows[b]["mean_itl_ms"] == pytest.approx(itl_ms, rel=0.1)


@pytest.mark.slow
def test_batch_sweep_small(tmp_path):
  out = _run("experiments.batch_sweep", "--small", f"--output_dir={tmp_path}")
  assert "MBU" in out
  d = json.loads((tmp_path / "batch_sweep.json").read_text())
  assert [r["batch"] for r in d["real"]] == [1, 4]
  assert all(0 < r["mbu"] < 1.5 for r in d["real"])


def test_prefix_reuse_strategies_and_tiers():
  """8.3.3-8.3.4 on the simulator: appending keeps the prefix, rewriting the head loses
  all reuse, a small pool loses part of it to interfering requests, and a host tier
  serves the evicted pages instead of recomputing them."""
  from experiments import prefix_reuse as pr
  shape = pr.SessionShape()

  def run(gib, strat, host=0):
    eng = pr.sim_engine(gib, host)
    return pr.summarize_run(eng, pr.run_session(eng, shape, strat, rounds=6))

  big, head = run(6, "append"), run(6, "rewrite_head")
  small, tiered = run(1, "append"), run(1, "append", host=2000)
  assert big["session_cached_tokens"] > 0.7 * big["session_prompt_tokens"]
  assert head["session_cached_tokens"] == 0 and head["mean_ttft_s"] > big["mean_ttft_s"]
  assert small["session_cached_tokens"] < big["session_cached_tokens"]
  assert tiered["host_hit_tokens"] > 0
  assert tiered["session_cached_tokens"] == big["session_cached_tokens"]


@pytest.mark.slow
def test_prefix_reuse_real_small(tmp_path):
  out = _run("experiments.prefix_reuse", "--executor=jax", "--small",
             f"--output_dir={tmp_path}")
  d = json.loads((tmp_path / "prefix_reuse_jax.json").read_text())
  append = [r for r in d if r["strategy"] == "append"][0]
  assert append["session_cached_tokens"] > 0 and "mean TTFT" in out
