"""The soak and chaos tool, briefly (slow: not in the default suite). Its checks are the
tool's own: every response proper, nothing lost or duplicated, refusals agreeing with the
server's metrics, the pool idle afterwards, memory steady, SIGTERM exiting 0."""
import json
import subprocess
import sys

import pytest

from experiments.common import ROOT


@pytest.mark.slow
def test_a_short_soak_holds_every_check(tmp_path):
  out = subprocess.run([sys.executable, "tools/soak.py", "--minutes=1", "--concurrency=3",
                        f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rep = json.loads((tmp_path / "soak.json").read_text())
  assert all(c["ok"] for c in rep["checks"].values())
  kinds = set(rep["by_kind"])
  assert rep["requests"] >= 10 and {"chat", "constrained", "malformed"} & kinds
