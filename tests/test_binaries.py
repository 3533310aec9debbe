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
