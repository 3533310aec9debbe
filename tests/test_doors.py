"""ARCHITECTURE.md doors: the host runtime imports no JAX; pallas_kernels only jax/numpy."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_runtime_imports_no_jax():
  code = ("import sys\n"
          "import jaxinfer.runtime.engine, jaxinfer.runtime.speculative, jaxinfer.metrics\n"
          "import jaxinfer.runtime.accounting, jaxinfer.costmodel.formulas\n"
          "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]\n"
          "assert not bad, bad\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pallas_kernels_import_only_jax_and_numpy():
  allowed = {"jax", "numpy", "pallas_kernels", "__future__", "functools", "math", "dataclasses",
             "typing"}
  for f in (ROOT / "pallas_kernels").rglob("*.py"):
    for node in ast.walk(ast.parse(f.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module]
      for n in names:
        assert n.split(".")[0] in allowed, f"{f.name} imports {n}"
