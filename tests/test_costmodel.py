"""Cost model: sizes derived from the config, formulas pinned on the chapter's cases, the
roofline calibrated on the 8-1 table, and configuration selection (8.6.3)."""
import math

import pytest

from jaxinfer.config import QWEN3_8B
from jaxinfer.costmodel import ModelCosts, RooflineStepModel
from jaxinfer.costmodel import formulas as F
from jaxinfer.costmodel.select import select
from jaxinfer.executors.sim_executor import SimExecutor

MIB = 2**20


@pytest.fixture(scope="module")
def rtx():
  return RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")


def test_sizes_derived_from_config():
  c = ModelCosts(QWEN3_8B)
  assert c.weight_bytes == 16_381_470_720
  assert c.d_w == 15_136_811_008
  assert c.ffn_bytes_per_layer == 288 * MIB
  assert c.kv_bytes_per_token == 147_456


@pytest.mark.parametrize("batch,bytes_gb,round_ms", [(1, 15.44, 26.26), (4, 16.34, 26.62),
                                                     (16, 19.97, 27.44), (64, 34.46, 29.63)])
def test_roofline_reproduces_8_1_decode_rounds(rtx, batch, bytes_gb, round_ms):
  assert rtx.costs.step_bytes([(1, 2048)] * batch) == pytest.approx(bytes_gb * 1e9, rel=2e-3)
  assert 1e3 * rtx.decode_round(batch, 2048) == pytest.approx(round_ms, rel=0.02)


def test_roofline_predicts_8k_with_6k_cached_prefill(rtx):
  """Batch 16, 2048 new tokens on 6144 cached: measured 2.04 s (58% MFU)."""
  assert rtx.prefill_time(16, 2048, 6144) == pytest.approx(2.04, rel=0.05)
  assert rtx.prefill_time(1, 2048) == pytest.approx(0.0948, rel=0.02)  # ~96 ms with 1st token


def test_rates(rtx):
  """8.6.3 at batch 16, 2K: r_D = 16 / 27.44 ms = 583 calls/s; r_P = 32,768 tokens over
  475 TFLOP / (503.8 TFLOP/s x 61%) = 1.546 s, i.e. 21,200 tokens/s; t_GPU for one
  2048-in / 256-out request = 2048 / r_P + 255 / r_D = 0.534 s."""
  r = rtx.rates(16, 2048, 2048)
  assert r["r_decode"] == pytest.approx(583.1, rel=0.01)
  assert r["r_prefill"] == pytest.approx(21_200, rel=0.01)
  assert F.gpu_seconds(2048, 256, r["r_prefill"], r["r_decode"]) == pytest.approx(0.534,
                                                                                   rel=0.01)


def test_weight_reuse_formulas():
  """8.2.1 on the chapter's Qwen3-8B inputs (D_w = 15,136,811,008 B, k = 144 KiB per token),
  values worked out by hand: 4 requests at 2048 tokens read 16.34 GB a round, 4.09 GB
  per output token (0.30 GB with the weights in ROM); KV reads reach weight reads at
  51 requests."""
  d_w, k = 15_136_811_008, 147_456
  assert F.bytes_per_round(d_w, 4, 2048, k) == 16_344_770_560
  assert F.bytes_per_output_token(d_w, 4, 2048, k) == 4_086_192_640
  assert F.bytes_per_output_token(d_w, 4, 2048, k, weights_in_rom=True) == 301_989_888
  assert F.b_kv(d_w, 2048, k) == 51 and F.b_kv(d_w, 2048 * 51, k) == 1
  assert F.weight_arithmetic_intensity(8, 2) == 8  # 2 b / s_w: 8 rows of 2-byte weights
  assert F.chunk_pairs(512, 7680) == 4_063_488  # a 512-token chunk after 7680 cached


def test_prefix_value_formulas():
  assert F.prefix_value(0.5, 0.3, 0.02, 0.01) == pytest.approx(0.13)
  assert F.hit_probability_threshold(0.3, 0.02, 0.014) == pytest.approx(0.05)
  assert F.hit_probability_threshold(0.01, 0.02, 0.0) == math.inf  # fetching is slower
  assert F.saving_per_mib(1.0, 0.3, 0.0, 0.0, 3 * MIB) == pytest.approx(0.1)


def test_kv_compression_and_fp8_crossover():
  """8.4.2: BF16 6.44 + 4.37e-5 L vs FP8 6.58 + 2.37e-5 L (ms) cross near 7000 tokens."""
  assert F.linear_crossover(6.44, 4.37e-5, 6.58, 2.37e-5) == pytest.approx(7000)
  assert F.kv_compression_gain(1e9, 1e12, 2e-4) == pytest.approx(8e-4)


def test_offload_formulas_for_nine_ffn_sets():
  """8.4.3: 9 of 36 FFN sets of 288 MiB offloaded; 2 prefetch buffers kept on device."""
  s = 288 * MIB
  m = F.offload_memory(s, 9, 2)
  assert (m["freed_bytes"], m["buffer_bytes"], m["net_bytes"]) == (9 * s, 2 * s, 7 * s)
  assert F.offload_copy_time(s, 9, 64e9) == pytest.approx(0.04247, rel=1e-3)  # PCIe: 42.5 ms
  assert F.offload_copy_time(s, 9, 450e9) == pytest.approx(0.00604, rel=1e-3)  # NVLink-C2C
  compute, copy = [1.0, 1.0, 1.0], [2.0, 0.0, 2.0]
  assert F.offload_step_time(compute, copy, 1) == pytest.approx(6.0)  # copy, 3 layers, copy waits
  assert F.offload_step_time(compute, copy, 2) == pytest.approx(5.0)  # second copy overlaps
  assert F.offload_step_time([0.1] * 3, [1.0] * 3, 2) >= 3.0  # never shorter than its copies
  assert F.compressed_transfer_pays(r_dec=300e9, link_bandwidth=64e9, ratio=0.5)
  assert not F.compressed_transfer_pays(r_dec=100e9, link_bandwidth=64e9, ratio=0.5)


def test_speculation_formulas():
  assert F.expected_tokens(0.5, 3) == pytest.approx(1.875)
  assert F.expected_tokens([0.9, 0.5]) == pytest.approx(2.35)
  assert F.time_per_token([10, 30], [1, 4]) == pytest.approx(8.0)  # not mean(10, 7.5)
  assert F.should_lengthen(10.0, 2.0, 11.0, 2.5)  # dT/dN = 2 < T/N = 5
  assert not F.should_lengthen(10.0, 2.0, 14.0, 2.5)  # 8 > 5
  assert F.draft_break_even(15.2, 16.9) < 1  # a DFlash round is cheaper than a plain step
  assert F.amortized_index_cost(2.0, 1000) == pytest.approx(0.002)


def test_littles_law_and_amdahl():
  assert F.littles_law(4.0, 2.5) == 10.0
  assert F.amdahl(0.8, 3.0) == pytest.approx(15 / 7)
  assert F.goodput(12, 4.0) == 3.0


def test_select_reproduces_the_chapter():
  """12 GiB / 256 tokens: A does not fit (16 x 1188 MiB), B fits but takes ~9.0 s
  (> 7 s), C's full 8K prefills alone take > 7 s, D (4.5 s) beats E (5.5 s) on
  GPU-seconds per good result."""
  res, chosen = select()
  r = {x.name: x for x in res}
  assert chosen == "D"
  assert r["A"].kv_mib == 16 * 1188 and not r["A"].fits_memory
  assert r["B"].kv_mib == 864 + 16 * 324 and r["B"].fits_memory and not r["B"].meets_deadline
  assert r["B"].total_s == pytest.approx(9.02, rel=0.03)  # the chapter's 9.02 s median
  assert r["C"].fits_memory and not r["C"].meets_deadline
  assert r["D"].kv_mib == 864 + 16 * 324 + 3188 and r["D"].rounds == 85
  assert r["E"].rounds == 128 and r["E"].meets_deadline
  assert r["D"].joules_per_good == pytest.approx(r["D"].gpu_s_per_good * 600)


def test_select_reselects_at_6_gib_and_16_tokens():
  res, chosen = select(kv_budget_gib=6)
  assert chosen == "E"  # D's draft model no longer fits
  assert not {x.name: x for x in res}["D"].fits_memory
  res, chosen = select(output_tokens=16)
  r = {x.name: x for x in res}
  assert r["B"].meets_deadline and chosen == "E"  # short outputs: the draft's prefill cost
  assert r["E"].total_s < r["D"].total_s < r["B"].total_s


def test_roofline_drives_the_simulator(rtx):
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  ex = SimExecutor(rtx, num_pages=5461, page_size=16)
  eng = Engine(ex, SchedulerConfig("continuous", 64, 1 << 20, 1 << 20),
               buckets=BucketTable.default(1 << 17, 64, 4096))
  for i in range(16):
    eng.add_request([i] * 2048, SamplingParams(max_tokens=256, ignore_eos=True), arrival_time=0)
  reqs = eng.run()
  itl = sum(r.itls[5] for r in reqs) / 16
  assert itl == pytest.approx(rtx.decode_round(16, 2048 + 6), rel=0.01)


@pytest.mark.parametrize("hardware,link_gbs", [("rtx-pro-6000", 64), ("gh200", 450)])
def test_offload_accounting_nine_ffn_sets(hardware, link_gbs):
  """8.4.3 for Qwen3-8B: 9 of 36 FFN sets (288 MiB each) in host memory."""
  from jaxinfer.costmodel import load_hardware
  from jaxinfer.costmodel.offload import OffloadConfig, account, step_time
  hw = load_hardware(hardware)
  assert hw.link_bandwidth == link_gbs * 1e9
  for buffers in (1, 2):
    off = OffloadConfig.count(36, 9, buffers)
    assert len(off.layers) == 9
    a = account(QWEN3_8B, off, hw.link_bandwidth, 8192 * 147456, 8447 * 147456)
    m = F.offload_memory(288 * MIB, 9, buffers)
    assert a.freed_mib == 9 * 288 and a.buffer_mib == 288 * buffers
    assert a.net_mib == m["net_bytes"] / MIB
    # 9 x 288 MiB = 2.72 GB over the link: 42.5 ms on PCIe, 6.04 ms on NVLink-C2C
    assert a.copy_ms_per_step == pytest.approx({64: 42.47, 450: 6.040}[link_gbs], rel=1e-3)
    t = step_time(0.0266, QWEN3_8B, off, hw.link_bandwidth)
    assert t >= a.copy_ms_per_step / 1e3  # never shorter than its copies
  serial = step_time(0.0266, QWEN3_8B, OffloadConfig.count(36, 18, 1), 64e9)
  overlapped = step_time(0.0266, QWEN3_8B, OffloadConfig.count(36, 18, 2), 64e9)
  assert overlapped < serial
  assert OffloadConfig.to_free(QWEN3_8B, 2000).layers == OffloadConfig.count(36, 9).layers


def test_calibration_passes_through_every_measured_point():
  """Every measured point the calibration table holds (the chapter's 8-1 decode rounds and
  prefill MFUs, and 8.6.3's 8K-with-6K-cached batch-16 run) comes back from the model:
  decode rounds and prefill MFU exactly (the model's bytes per round within 0.05% of the
  chapter's), and 8.6.3's prefill of 32,768 new tokens in 2.04 s."""
  import json
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.costmodel.roofline import CALIBRATION_DIR
  with open(f"{CALIBRATION_DIR}/rtx-pro-6000.json") as f:
    table = json.load(f)
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000", "bf16", 16)
  assert len(table["decode"]) == 5 and len(table["prefill"]) == 5
  for e in table["decode"]:
    t = rm.decode_round(e["batch"], e["context"], e.get("shared", 0))
    assert 1e3 * t == pytest.approx(e["round_ms"], rel=1e-12), e
    if "bytes" in e:  # the chapter's bytes per round against the model's
      b = rm.costs.step_bytes([(1, e["context"])] * e["batch"])
      assert b == pytest.approx(e["bytes"], rel=5e-4), e
  for e in table["prefill"]:
    h = e["cached"]
    f = rm.costs.step_flops([(e["input"] - h, h)] * e["batch"])
    assert rm.calib.mfu_at(f, h / e["input"]) == pytest.approx(e["mfu"], rel=1e-12), e
  assert rm.prefill_time(16, 2048, 6144) == pytest.approx(2.04, rel=0.01)
  # Between points the cached share moves MFU between the two curves, never past them.
  f = rm.costs.step_flops([(2048, 2048)] * 16)
  assert rm.calib.mfu_at(f, 0.0) > rm.calib.mfu_at(f, 0.5) > rm.calib.mfu_at(f, 0.75)


def test_tensor_parallel_step_model():
  """Each device reads and computes 1/tp of the step; every layer pays two all-reduces of
  [T, D] over the device link. Decode (weight-bound, tiny messages) speeds up with tp on
  NVLink; on PCIe the all-reduces take a larger share; a prefill's messages are T x D."""
  h200 = {tp: RooflineStepModel.for_names("qwen3-8b", "h200-sxm", tp=tp) for tp in (1, 2, 4)}
  pcie = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000", tp=4)
  dec = [(1, 2048)] * 16
  assert h200[1].comm_time(dec) == 0.0
  assert h200[4].step_time(dec) < h200[2].step_time(dec) < h200[1].step_time(dec)
  assert pcie.comm_time(dec) > h200[4].comm_time(dec)
  # a 8192-token prefill on 4 devices: 72 all-reduces of 8192 x 4096 bf16 (64 MiB) each,
  # 1.5 x 64 MiB through each device's link per all-reduce (ring: 2 (n - 1) / n)
  pre = [(8192, 0)]
  msg = 8192 * 4096 * 2
  link = 64e9
  expect = 72 * (1.5 * msg / link + 6 * 10e-6)
  assert math.isclose(pcie.comm_time(pre), expect, rel_tol=1e-9)
  with pytest.raises(ValueError, match="tp=3 does not divide qwen3-8b's num_heads=32"):
    RooflineStepModel.for_names("qwen3-8b", "h200-sxm", tp=3)
  with pytest.raises(ValueError, match="no device-to-device link"):
    RooflineStepModel.for_names("qwen3-8b", "m2-max", tp=2)


def test_breakdown_itemises_the_step_time():
  """The planner's FLOPs / bytes / MFU / MBU per phase are the ones its step time uses:
  compute = FLOPs / (P x MFU), memory = bytes / (beta x MBU), the time their max; 8.6.3's
  prefill is compute-bound, its decode round memory-bound."""
  from jaxinfer.costmodel import RooflineStepModel
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")
  for seqs, bound in (([(2048, 6144)] * 16, "compute"), ([(1, 8320)] * 16, "memory")):
    b = rm.breakdown(seqs, 6144)
    assert b["bound"] == bound
    assert b["compute_s"] == pytest.approx(b["flops"] / (rm.hw.peak_flops * b["mfu"]))
    assert b["memory_s"] == pytest.approx(b["bytes"] / (rm.hw.bandwidth * b["mbu"]))
    assert b["time_s"] == pytest.approx(max(b["compute_s"], b["memory_s"]))
    assert b["time_s"] == rm.step_time(seqs, 6144)


@pytest.mark.parametrize("model,tp,calibration", [
    ("qwen3-8b", 1, "auto"), ("qwen3-8b", 2, "auto"), ("gemma-2-9b", 1, "auto"),
    ("deepseek-v3", 1, "auto"), ("mixtral-8x7b", 1, None)])
def test_decode_times_equal_step_times(model, tp, calibration):
  """The fast-forward's rounds (decode_times: n rounds of one batch whose contexts grow by
  one per round) cost exactly, bit for bit, what step_time charges each round: full and
  sliding-window layers, soft caps, latent attention, experts, tensor parallelism, a
  shared prefix, with and without a calibration table."""
  import numpy as np
  rm = RooflineStepModel.for_names(model, "rtx-pro-6000", calibration=calibration, tp=tp)
  rng = np.random.default_rng(0)
  for batch in (1, 5, 32):
    ctx = rng.integers(0, 6000, batch).tolist()
    for shared, sharing in ((0, None), (1024, min(batch, 3))):
      got = rm.decode_times(ctx, 200, shared, sharing).tolist()
      want = [rm.step_time([(1, h + k) for h in ctx], shared, sharing) for k in range(200)]
      assert got == want
