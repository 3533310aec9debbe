"""The figures of chapter 8.1 / 8.3 from the accounting functions and the two binaries."""
import json
import subprocess
import sys

from jaxinfer.config import QWEN3_8B
from jaxinfer.kv import bytes_per_token
from jaxinfer.costmodel import accounting

MIB = 2**20


def test_three_policies_small_example():
  """Lengths 9, 13, 5, 15, max 16, p = 4; A and B share their first 8 tokens (8.3.1)."""
  whole, paged, shared = accounting.account([9, 13, 5, 15], 16, 4, [(0, 1, 8)])
  assert (whole.reserved_slots, whole.unused_slots, whole.physical_pages) == (64, 22, 16)
  assert (paged.allocated_slots, paged.unused_slots, paged.page_table_entries) == (52, 10, 13)
  assert (shared.physical_pages, shared.page_table_entries, shared.allocated_slots) == (11, 13, 44)


def test_branching_example():
  paged, shared = accounting.account_branches(4, 95, 9, 16)
  assert paged.physical_pages == 416 and shared.physical_pages == 95 + 36
  assert shared.page_table_entries == 416


def test_capacity_long_context_with_shared_prefix():
  """8.3.2: 864 MiB prefix + 324 MiB per request (2303 private tokens -> 2304 slots)."""
  k = bytes_per_token(QWEN3_8B, "bf16")
  cap = accounting.capacity(k, 12 * 2**30, 8192, 256, 16, shared_prefix=6144)
  assert cap.shared_prefix_bytes == 864 * MIB and cap.private_end_bytes == 324 * MIB
  assert cap.requests_fit == (12 * 1024 - 864) // 324 == 35
  alone = accounting.capacity(k, 12 * 2**30, 8192, 256, 16)
  assert alone.kv_end_bytes == 1188 * MIB and alone.requests_fit == 10
  chat = accounting.capacity(k, 12 * 2**30, 2048, 256, 16)
  assert chat.kv_end_bytes == 324 * MIB and chat.requests_fit == 37


def _run(*args):
  out = subprocess.run([sys.executable, "-m", *args, "--json"], capture_output=True, text=True,
                       check=True)
  return json.loads(out.stdout)


def test_binaries_emit_the_figures():
  rows = _run("experiments.kv_accounting", "--lengths=9,13,5,15", "--max_len=16",
              "--page_size=4", "--share=A,B,8")
  assert [r["physical_pages"] for r in rows] == [16, 13, 11]
  # 42 tokens (9 + 13 + 5 + 15) stored; A and B's first 8 (two full pages) once when shared
  assert [r["stored_tokens"] for r in rows] == [42, 42, 34]
  assert [r["unused_slots"] for r in rows] == [64 - 42, 52 - 42, 44 - 34]
  rows = _run("experiments.kv_accounting", "--branches=4", "--prefix_pages=95",
              "--private_pages=9", "--page_size=16")
  assert [r["physical_pages"] for r in rows] == [416, 131]
  cap = _run("experiments.capacity", "--model=qwen3-8b", "--kv_budget_gib=12",
             "--input_tokens=8192", "--output_tokens=256", "--shared_prefix=6144")
  assert cap["requests_fit"] == 35 and cap["bytes_per_token"] == 147456
  q8 = _run("experiments.capacity", "--model=qwen3-8b", "--input_tokens=8192", "--kv_format=q8_0")
  assert q8["bytes_per_token"] == 147456 * 34 / 64
