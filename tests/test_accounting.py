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


def test_pages_held_behind_a_window_equal_the_page_manager():
  """The arithmetic of a sliding window's pages (accounting.pages_held, the planner's)
  against the real PageManager releasing what lies behind the window, token by token,
  over windows on and off page edges; never more than window / page + 1 pages."""
  from jaxinfer.runtime.pages import HOLE, PageManager
  for page_size, window in ((4, 8), (4, 9), (16, 64), (8, 3), (16, 1)):
    pm = PageManager(64, page_size)
    pm.add_sequence("r")
    for t in range(1, 200):
      pm.grow("r", t)
      pm.release_before("r", t - window + 1)
      held = sum(p != HOLE for p in pm.page_table("r"))
      assert held == accounting.pages_held(t, page_size, window), (page_size, window, t)
      assert held <= -(-window // page_size) + 1
    assert accounting.pages_held(100, page_size, 0) == accounting.pages_for(100, page_size)


def test_windowed_costs_and_capacity():
  """Mistral-7B (window 4096 in every layer) at 8,192 tokens: a decode step reads half the
  KV full attention would, its attention pairs stop growing past the window, and a
  12 GiB budget holds twice the requests; Gemma-2-9B (every other layer windowed) holds
  the global half whole."""
  from jaxinfer.config import GEMMA2_9B, MISTRAL_7B
  from jaxinfer.costmodel.roofline import ModelCosts
  m = ModelCosts(MISTRAL_7B)
  full = ModelCosts(MISTRAL_7B.replace(layer_windows=()))
  kv = m.step_bytes([(1, 8191)]) - m.d_w
  assert kv == 4096 * m.kv_bytes_per_token == (full.step_bytes([(1, 8191)]) - m.d_w) / 2
  assert m.attention_flops([(1, 8191)]) == m.attention_flops([(1, 4095)]) \
      == full.attention_flops([(1, 4095)])
  cap = accounting.capacity(m.kv_bytes_per_token, 12 * 2**30, 8192, 256, 16,
                            layer_windows=MISTRAL_7B.windows, step_tokens=256)
  assert (cap.requests_fit, cap.requests_fit_windowed) == (11, 22)
  g = ModelCosts(GEMMA2_9B)
  cap = accounting.capacity(g.kv_bytes_per_token, 12 * 2**30, 8192, 256, 16,
                            layer_windows=GEMMA2_9B.windows, step_tokens=256)
  per_layer_page = g.kv_bytes_per_token * 16 / 42
  # 8,447 tokens at the end: 528 pages; the last 4,096 keys (from 4,352 on) in 256 pages
  assert cap.windowed_end_bytes == int((21 * 528 + 21 * 256) * per_layer_page)
  capped = g.attention_flops([(1, 100)])
  assert capped > ModelCosts(GEMMA2_9B.replace(attn_softcap=None)).attention_flops([(1, 100)])


def test_kv_accounting_prints_the_window_groups():
  """512-token prompts, window 64, pages of 16: a Mistral-style request holds at most
  64 / 16 + 1 = 5 pages in decode; a Gemma-2-style one the same in its local group while
  its global group holds the whole context (the engine's own grouped page tables: it
  releases the local group's pages, keeps the global group's), 56% of full attention."""
  one = _run("experiments.kv_accounting", "--layer_windows=64", "--prompt_len=512",
             "--output_len=128", "--page_size=16")
  (g,) = one["groups"]
  assert g["pages_held_in_decode"] == g["formula_held"] == 5 and g["engine_releases"]
  assert g["full_attention_pages"] == 40
  two = _run("experiments.kv_accounting", "--layer_windows=64,0", "--num_layers=42",
             "--prompt_len=512", "--output_len=128", "--page_size=16")
  local, glob = two["groups"]
  assert (local["window"], local["layers"], local["pages_held_in_decode"]) == (64, 21, 5)
  assert (glob["window"], glob["pages_held_in_decode"]) == (0, 40)
  assert local["engine_releases"] and not glob["engine_releases"]
  assert two["kv_held_in_decode_vs_full_attention"] == (5 + 40) / 80


def test_plan_batch_reads_the_kv_a_window_holds():
  """`plan batch` for Mistral-7B (window 4,096): past the window every decode round reads
  the same KV per request, in its bytes columns and its round time alike."""
  long = _run("experiments.plan", "batch", "--model=mistral-7b", "--context=16384")
  win = _run("experiments.plan", "batch", "--model=mistral-7b", "--context=4096")
  assert long["kv_read_tokens"] == win["kv_read_tokens"] == 4096
  for a, b in zip(long["rows"], win["rows"]):
    assert a["bytes_per_round"] == b["bytes_per_round"] and a["round_ms"] == b["round_ms"]
  full = _run("experiments.plan", "batch", "--model=qwen3-8b", "--context=16384")
  assert full["kv_read_tokens"] == 16384
