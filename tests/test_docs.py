"""The front door: a short README, a docs site that builds strictly, generated pages that
match their generators, and comments that cite nothing outside the repository."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "bench_e2e_small.json")
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_readme_is_short_and_its_links_resolve():
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  assert len(text.splitlines()) <= 250
  links = re.findall(r"\]\(([^)#]+)", text)
  assert links
  for link in links:
    if "://" not in link:
      assert os.path.exists(os.path.join(ROOT, link)), link


def test_cli_page_is_generated_from_the_flags():
  import gen_cli_docs
  with open(os.path.join(ROOT, "docs", "cli.md")) as f:
    committed = f.read()
  page = gen_cli_docs.render()
  assert committed == page, "docs/cli.md is stale: run python tools/gen_cli_docs.py"
  from absl import flags
  from jaxinfer import cli
  for fl in flags.FLAGS.get_flags_for_module(cli.__name__):  # every flag, with its help
    assert f"`--{fl.name}`" in page


def test_report_writes_the_performance_page_from_json(tmp_path):
  import json
  import report
  out = tmp_path / "performance.md"
  text = report.render([FIXTURE], str(out))
  with open(FIXTURE) as f:
    data = json.load(f)
  assert out.read_text() == text
  assert data["machine"]["command"] in text and data["machine"]["cpu"] in text
  row = data["single"][0]
  assert f"| {row['prompts']} | {row['weight_format']} |" in text
  assert format(row["out_tok_s"], ".1f") in text
  assert (tmp_path / "img" / "performance_e2e.png").stat().st_size > 1000
  soak = os.path.join(ROOT, "tests", "data", "soak_small.json")  # a real one-minute run
  with open(soak) as f:
    srun = json.load(f)
  text = report.render([FIXTURE, soak], str(out))
  assert "## Soak" in text and f"{srun['requests']} requests" in text
  for name, chk in srun["checks"].items():
    assert f"| {name} | {'yes' if chk['ok'] else 'NO'} | {chk['detail']} |" in text
  serve = os.path.join(ROOT, "tests", "data", "serve_bench_small.json")  # a real run, its
  with open(serve) as f:  # per-request timings dropped
    sb = json.load(f)
  text = report.render([serve], str(out), plot=False)
  pol = sb["policies"]["chunked"]
  off = sb["offline"]["chunked"]
  ratio = pol["output_tok_s"] / (off["output_tokens"] / off["wall_s"])
  assert "## Serving" in text and f"| chunked | {pol['output_tok_s']:.1f} |" in text
  assert f"| {ratio:.2f} |" in text
  bad = tmp_path / "bad.json"
  bad.write_text('{"x": 1}')
  assert report.main(["report.py", str(bad), f"--output={tmp_path / 'x.md'}"]) == 2


def test_docs_site_builds_strictly(tmp_path):
  """Broken links, missing pages or an API reference that does not resolve fail."""
  if shutil.which("mkdocs") is None and subprocess.run(
      [sys.executable, "-m", "mkdocs", "--version"], capture_output=True).returncode:
    pytest.fail("mkdocs is not installed: pip install -e '.[test]'")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                      "-f", os.path.join(ROOT, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                     capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
  assert r.returncode == 0, r.stdout + r.stderr
  assert (tmp_path / "site" / "python-api" / "index.html").exists()
  assert "SamplingParams" in (tmp_path / "site" / "python-api" / "index.html").read_text()


_OUTSIDE = re.compile(r"JAX-FACTS|SPEC\.md|\bSPEC\b|ARCHITECTURE\.md|\bARCHITECTURE\b|"
                      r"STYLE\.md|\.\./shared|cpu_amx\.cc|the issue's")


def test_no_comment_cites_a_document_outside_the_repository():
  hits = []
  for top in ("jaxinfer", "pallas_kernels", "tools", "experiments", "configs", "tests"):
    for d, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        if not name.endswith((".py", ".cc", ".h", ".sh")) or name == "test_docs.py":
          continue
        path = os.path.join(d, name)
        with open(path, errors="replace") as f:
          for i, line in enumerate(f, 1):
            if _OUTSIDE.search(line):
              hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  assert not hits, "\n".join(hits)


def _code_files(tops=("jaxinfer", "pallas_kernels", "tools", "experiments", "configs", "tests")):
  for top in tops:
    for d, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        if name.endswith((".py", ".cc", ".h")):
          yield os.path.join(d, name)


def test_every_source_file_named_in_code_or_docs_exists():
  """A comment, docstring or page that names a .py / .cc / .h file names one that is here
  (a renamed file had left its old name behind in comments and the design page)."""
  here = {name for top in ("jaxinfer", "pallas_kernels", "tools", "experiments", "configs",
                           "tests", "docs")
          for _, _, files in os.walk(os.path.join(ROOT, top)) for name in files}
  named = re.compile(r"(?<![\w.])([\w/]+\.(?:py|cc|h))\b")
  pages = [os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
           if n.endswith(".md")] + [os.path.join(ROOT, "README.md")]
  missing = []
  for path in list(_code_files()) + pages:
    with open(path, errors="replace") as f:
      for i, line in enumerate(f, 1):
        if line.lstrip().startswith("#include"):
          continue
        for m in named.findall(line):
          if os.path.basename(m) not in here:
            missing.append(f"{os.path.relpath(path, ROOT)}:{i}: {m}")
  assert not missing, "\n".join(missing)


# A number with a unit of time, rate or throughput, or a date: what a measurement log is
# made of.
_MEASURED = re.compile(r"\d+(?:\.\d+)?\s?(?:ms|us|µs|GB/s|MB/s|GFLOP/s|TFLOP/s|tok/s)\b|"
                       r"20\d\d-\d\d-\d\d")


def test_no_comment_block_is_a_measurement_log():
  """Comments state intent; the measurements behind a choice live in docs/design.md. A
  block of more than three comment lines may carry at most one measured figure."""
  logs = []
  for path in _code_files():
    mark = "//" if path.endswith((".cc", ".h")) else "#"
    block = []
    with open(path, errors="replace") as f:
      lines = f.read().splitlines() + [""]
    for i, line in enumerate(lines, 1):
      if line.strip().startswith(mark):
        block.append(line)
        continue
      figures = sum(len(_MEASURED.findall(b)) for b in block)
      if len(block) > 3 and figures > 1:
        logs.append(f"{os.path.relpath(path, ROOT)}:{i - len(block)}: {len(block)} lines, "
                    f"{figures} figures")
      block = []
  assert not logs, "\n".join(logs)


STUDY_FIGURES = ("batch_sweep", "scheduling_budget", "scheduling_jax_chunked", "prefix_reuse",
                 "kv_quality_fidelity", "kv_quality_grids", "goodput", "config_select",
                 "buckets", "speculative", "offload", "lora", "moe_batching", "fleet",
                 "fleet_disagg")


def test_the_studies_page_shows_each_study_figure():
  """Each study's figure, as its binary writes it, is on the studies page."""
  page = open(os.path.join(ROOT, "docs", "studies.md")).read()
  shown = set(re.findall(r"!\[[^\]]*\]\(img/studies/([\w-]+)\.png\)", page))
  assert set(STUDY_FIGURES) <= shown, sorted(set(STUDY_FIGURES) - shown)
  for name in shown:
    assert os.path.getsize(os.path.join(ROOT, "docs", "img", "studies", name + ".png")) > 10_000
