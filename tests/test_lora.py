"""Multi-LoRA (8.2.1): PEFT adapters against HF transformers + peft, mixed batches against
each request alone, slots and their replacement, prefix-cache namespaces, bad adapters."""
import importlib.util
import json
import os

import numpy as np
import pytest

from conftest import requires_hf
from jaxinfer import LLM, SamplingParams
from jaxinfer.lora import AdapterError, load_peft, save_peft
from jaxinfer.runtime.adapter_slots import AdapterSlots
from jaxinfer.lora.adapter import random_adapter_factors

requires_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                   reason="the peft oracle needs the test extra")
ALL = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "My favourite food is"]


@pytest.fixture(scope="module")
def adapters(smollm2, tmp_path_factory):
  """Three tiny adapters in PEFT's format: A (every target, r=4), B (q and v, r=8,
  rsLoRA, an alpha_pattern for v), C (the MLP, r=2, only even layers)."""
  cfg = smollm2.cfg
  root = tmp_path_factory.mktemp("adapters")
  a, b = random_adapter_factors(cfg, 4, ALL, seed=1)
  save_peft(str(root / "A"), a, b, cfg, rank=4, alpha=8)
  a, b = random_adapter_factors(cfg, 8, ("wq", "wv"), seed=2, std=0.04)
  save_peft(str(root / "B"), a, b, cfg, rank=8, alpha=16)
  conf_path = root / "B" / "adapter_config.json"
  conf = json.loads(conf_path.read_text())
  conf.update(use_rslora=True, alpha_pattern={"v_proj": 4.0})
  conf_path.write_text(json.dumps(conf))
  a, b = random_adapter_factors(cfg, 2, ("w_gate", "w_up", "w_down"), seed=3, std=0.08)
  for t in a:
    a[t][1::2] = 0.0  # odd layers untouched: written as zeros, loaded as zeros
  save_peft(str(root / "C"), a, b, cfg, rank=2, alpha=2)
  return {n: str(root / n) for n in "ABC"}


def test_adapter_layout_follows_peft_scaling(smollm2, adapters):
  A = load_peft(adapters["A"], smollm2.cfg, "A")
  B = load_peft(adapters["B"], smollm2.cfg, "B")
  assert A.rank == 4 and A.targets == ALL and B.targets == ("wq", "wv")
  import chex  # A round-trips through PEFT's files: its factors, B scaled by alpha / r
  a, b = random_adapter_factors(smollm2.cfg, 4, ALL, seed=1)
  chex.assert_trees_all_close(dict(A.weights), {t: (a[t], b[t] * 8 / 4) for t in ALL},
                              rtol=1e-6)
  from safetensors.numpy import load_file
  raw = load_file(os.path.join(adapters["B"], "adapter_model.safetensors"))
  pre = "base_model.model.model.layers.3.self_attn."
  # rsLoRA: alpha / sqrt(r); alpha_pattern overrides v_proj's alpha
  np.testing.assert_allclose(B.weights["wq"][1][3], raw[pre + "q_proj.lora_B.weight"].T *
                             16 / np.sqrt(8), rtol=1e-6)
  np.testing.assert_allclose(B.weights["wv"][1][3], raw[pre + "v_proj.lora_B.weight"].T *
                             4 / np.sqrt(8), rtol=1e-6)


@pytest.fixture(scope="module")
def peft_ref(smollm2, smollm2_path, adapters):
  """HF transformers + peft on one prompt: the logits at every position of the base model
  and of each adapter A, B, C, and adapter A's 8 greedy tokens."""
  import torch
  from peft import PeftModel
  from jaxinfer.benchmarking import hf_model
  ids = smollm2.tokenizer.encode("The capital of France is a city where")
  hf = hf_model(smollm2_path)
  x = torch.tensor([ids])
  with torch.no_grad():
    ref = [hf(x).logits[0].numpy()]
  for name in "ABC":
    pm = PeftModel.from_pretrained(hf, adapters[name]).eval()
    with torch.no_grad():
      ref.append(pm(x).logits[0].numpy())
      if name == "A":
        greedy = pm.generate(x, max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    hf = pm.unload()  # the bare base model again
  assert np.abs(ref[1] - ref[0]).max() > 1.0  # the adapters change the output
  return ids, ref, greedy


def _check_modes_against_peft(smollm2, adapters, peft_ref, modes):
  """One prefill step carrying the base model and A, B, C (4 requests, one slot each), its
  logits at every prompt position against peft's, under each grouped-product mode."""
  from jaxinfer.executors.jax_executor import JaxExecutor
  from jaxinfer.runtime.batcher import SeqWork, pack_exact
  ids, ref, _ = peft_ref
  n = len(ids)
  loaded = [load_peft(adapters[x], smollm2.cfg, x) for x in "ABC"]
  ex = JaxExecutor(smollm2.cfg, smollm2.params, num_pages=64, page_size=16,
                   lora_adapters=loaded, max_loras=3, max_lora_rank=8)
  ex.load_lora([(1, "A"), (2, "B"), (3, "C")])
  works = [SeqWork(ids, 0, list(range(4 * i, 4 * i + 4)), num_logits=n, lora_slot=i)
           for i in range(4)]  # slot 0 = the base model
  for mode in modes:
    ex.lora_mode = mode
    _, logits = ex.logits(pack_exact(works, 16, 64))
    for i, r in enumerate(ref):
      got = logits[i * n:(i + 1) * n]
      err = np.abs(got - r).max() / np.abs(r).max()
      assert err < 1e-4, (mode, i, err)
      assert (got.argmax(-1) == r.argmax(-1)).all(), (mode, i)


@requires_hf
@requires_peft
def test_logits_and_greedy_tokens_match_hf_peft(smollm2, adapters, peft_ref, lora_llm):
  """The executor's own choice of grouped product for a prefill against peft's logits; the
  engine's greedy decode under adapter A (its decode steps' mode) against peft's."""
  _check_modes_against_peft(smollm2, adapters, peft_ref, [None])
  ids, _, greedy = peft_ref
  out = lora_llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, lora="A"))[0]
  assert out.token_ids == greedy


@requires_hf
@requires_peft
@pytest.mark.slow
def test_every_lora_mode_and_the_gguf_blocks_match_hf_peft(smollm2, adapters, peft_ref):
  """Every mode of the grouped low-rank product (gather / segment / ragged / dense) against
  peft, and adapter A over the GGUF blocks (fused q,k,v and gate,up; the prompt's tokens
  and every decode step read them) against peft's greedy tokens."""
  from jaxinfer.lora import ops
  _check_modes_against_peft(smollm2, adapters, peft_ref, ops.MODES)
  from pallas_kernels.cpu import gguf
  if gguf.available():
    ids, _, greedy = peft_ref
    llm = LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
              lora_adapters={"A": adapters["A"]}, weight_format="gguf")
    out = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, lora="A"))[0]
    assert out.token_ids == greedy


@pytest.fixture(scope="module")
def lora_llm(smollm2, adapters):
  return LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=32,
             prefix_cache=True, lora_adapters=adapters, max_loras=2, num_pages=256)


def _alone(llm, prompt, lora, n=10):
  return llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True,
                                               lora=lora))[0].token_ids


@pytest.mark.slow
def test_a_mixed_batch_equals_each_request_alone(lora_llm):
  """Adapters A, B, C and none in one chunked batch, with more adapters (3) than slots
  (2): every output equals the same request run alone; a step never carries more
  distinct adapters than slots, and an adapter in use is never replaced."""
  llm = lora_llm
  loras = ["A", "B", None, "C", "A", None]
  prompts = [PROMPTS[i % 4] for i in range(len(loras))]
  alone = [_alone(llm, p, x) for p, x in zip(prompts, loras)]
  assert alone[0] != alone[2] and alone[1] != alone[2] and alone[3] != alone[2]
  eng = llm.engine
  slots = eng.scheduler.adapters
  reqs = [eng.add_request(llm.encode_prompt(p), SamplingParams(max_tokens=10, ignore_eos=True,
                                                               lora=x))
          for p, x in zip(prompts, loras)]
  seen_per_step = []
  while eng.has_unfinished():
    eng.step()
    running = {r.sampling.lora for r in eng.scheduler.running if r.sampling.lora}
    seen_per_step.append(len(running))
    for r in eng.scheduler.running:  # a running request's adapter is in its slot
      if r.sampling.lora:
        assert slots.slot_of[r.sampling.lora] == r.lora_slot
  assert max(seen_per_step) <= 2
  assert [r.output_token_ids for r in reqs] == alone
  assert slots.num_evictions >= 1 and not slots.users


def test_prefix_cache_entries_belong_to_their_adapter(lora_llm):
  llm = lora_llm
  prompt = llm.encode_prompt("Here is a long shared system prompt about gardening. " * 4)
  run = lambda x: llm.engine.add_request(prompt, SamplingParams(max_tokens=2, lora=x))  # noqa
  r1 = run("A")
  llm.engine.run()
  r2, r3, r4 = run("B"), run("A"), run(None)
  llm.engine.run()
  assert r1.cached_tokens == 0 and r2.cached_tokens == 0 and r4.cached_tokens == 0
  assert r3.cached_tokens >= 32  # A's own pages


def test_bad_adapters_fail_early_and_the_engine_serves_on(smollm2, lora_llm, adapters,
                                                            tmp_path):
  from jaxinfer.config import ModelConfig
  llm = lora_llm
  with pytest.raises(ValueError, match=r"unknown LoRA adapter 'Z'.*\['A', 'B', 'C'\]"):
    llm.generate(["hi"], SamplingParams(lora="Z"))
  with pytest.raises(ValueError, match="lora must be an adapter name"):
    SamplingParams(lora="")
  with pytest.raises(AdapterError, match="rank 8 is above max_lora_rank=4"):
    load_peft(adapters["B"], smollm2.cfg, "B", max_rank=4)
  other = ModelConfig(name="tiny", family="qwen3", vocab_size=128, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=True,
                      max_position=256, qk_norm=True)
  a, b = random_adapter_factors(other, 2, ("wq",))
  save_peft(str(tmp_path / "tiny"), a, b, other, rank=2, alpha=2)
  with pytest.raises(AdapterError, match=r"'tiny'.*q_proj: lora_A \(2, 64\).*in=576"):
    llm.add_lora("tiny", str(tmp_path / "tiny"))
  from safetensors.numpy import save_file
  bad = tmp_path / "head"
  bad.mkdir()
  (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
  save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((2, 576), np.float32)},
            str(bad / "adapter_model.safetensors"))
  with pytest.raises(AdapterError, match="'head'.*'base_model.model.lm_head.lora_A.weight'"):
    llm.add_lora("head", str(bad))
  with pytest.raises(AdapterError, match="adapter_config.json not found"):
    llm.add_lora("none", str(tmp_path))
  conf = json.loads(open(os.path.join(adapters["A"], "adapter_config.json")).read())
  (tmp_path / "dora").mkdir()
  (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(dict(conf, use_dora=True)))
  with pytest.raises(AdapterError, match="use_dora=true is not supported"):
    load_peft(str(tmp_path / "dora"), smollm2.cfg)
  with pytest.raises(ValueError, match="max_loras must be an integer >= 0"):
    LLM(smollm2, warmup=False, max_loras=-1)
  assert sorted(llm.executor.lora_adapters) == ["A", "B", "C"]  # nothing registered
  assert _alone(llm, PROMPTS[0], "B", 4) == _alone(llm, PROMPTS[0], "B", 4)  # serves on
  llm.add_lora("A2", adapters["A"])  # a good one registers while serving
  assert _alone(llm, PROMPTS[0], "A2") == _alone(llm, PROMPTS[0], "A")


def test_non_finite_adapters_are_refused_on_load(smollm2, lora_llm, adapters, tmp_path):
  from safetensors.numpy import load_file, save_file
  from jaxinfer.lora.adapter import LoraAdapter
  llm = lora_llm
  before = sorted(llm.executor.lora_adapters)
  raw = load_file(os.path.join(adapters["A"], "adapter_model.safetensors"))
  for bad, value in (("nan", np.nan), ("inf", np.inf)):
    t = dict(raw)
    key = "base_model.model.model.layers.5.mlp.up_proj.lora_B.weight"
    t[key] = t[key].copy()
    t[key][3, 1] = value
    (tmp_path / bad).mkdir()
    save_file(t, str(tmp_path / bad / "adapter_model.safetensors"))
    (tmp_path / bad / "adapter_config.json").write_text(
        open(os.path.join(adapters["A"], "adapter_config.json")).read())
    with pytest.raises(AdapterError, match=rf"'{bad}'.*w_up lora_B.*1 non-finite.*layer 5"):
      llm.add_lora(bad, str(tmp_path / bad))
  t = dict(raw)  # integer weights are not an adapter
  key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
  t[key] = t[key].astype(np.int32)
  (tmp_path / "int").mkdir()
  save_file(t, str(tmp_path / "int" / "adapter_model.safetensors"))
  (tmp_path / "int" / "adapter_config.json").write_text(
      open(os.path.join(adapters["A"], "adapter_config.json")).read())
  with pytest.raises(AdapterError, match="q_proj lora_A has dtype int32"):
    llm.add_lora("int", str(tmp_path / "int"))
  good = load_peft(adapters["A"], smollm2.cfg, "obj")  # built in Python, not read from disk
  a, b = good.weights["wq"]
  b = b.copy()
  b[0, 0, 0] = np.inf
  with pytest.raises(AdapterError, match="'obj'.*wq lora_B"):
    llm.executor.register_lora(LoraAdapter("obj", good.rank, dict(good.weights, wq=(a, b))))
  assert sorted(llm.executor.lora_adapters) == before  # nothing registered


def test_an_adapter_that_overflows_fails_only_its_requests_and_is_disabled(smollm2, adapters,
                                                                            tmp_path):
  """Finite weights that overflow at run time: the requests using that adapter fail, every
  other request (base model, other adapters, in the same batch and after) is untouched,
  the adapter is refused until added again."""
  cfg = smollm2.cfg
  a, b = random_adapter_factors(cfg, 4, ("wq",), seed=5)
  a["wq"] = np.sign(a["wq"]) * np.float32(3e38)  # x @ a overflows to Inf
  save_peft(str(tmp_path / "X"), a, b, cfg, rank=4, alpha=4)
  llm = LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=32,
            prefix_cache=True, lora_adapters={"A": adapters["A"]}, max_loras=2,
            num_pages=256)
  llm.add_lora("X", str(tmp_path / "X"))  # every weight finite: accepted
  expect = {lora: _alone(llm, PROMPTS[1], lora) for lora in ("A", None)}
  sp = lambda lora: SamplingParams(max_tokens=10, ignore_eos=True, lora=lora)  # noqa: E731
  outs = [(o.finish_reason, o.token_ids, o.error)
          for o in llm.generate([PROMPTS[1]] * 3, [sp("X"), sp("A"), sp(None)])]
  assert outs[0][0] == "error" and "non-finite" in outs[0][2]
  assert outs[1][:2] == ("length", expect["A"]) and outs[2][:2] == ("length", expect[None])
  with pytest.raises(ValueError, match="LoRA adapter 'X' is disabled.*add it again"):
    llm.generate(["hi"], sp("X"))
  assert _alone(llm, PROMPTS[1], "A") == expect["A"]  # its slot no longer poisons a step
  llm.add_lora("X", adapters["A"])  # registered again (other weights): served
  assert _alone(llm, PROMPTS[1], "X") == expect["A"]


def test_adapter_slots_pin_running_adapters_and_replace_the_least_recently_used():
  s = AdapterSlots(2)
  assert s.acquire("a") == 1 and s.acquire("b") == 2 and s.acquire("a") == 1
  assert s.take_loads() == [(1, "a"), (2, "b")]
  assert not s.can_acquire("c")  # both pinned
  s.release("b")
  assert s.can_acquire("c") and s.acquire("c") == 2 and s.num_evictions == 1
  s.release("a")
  s.release("a")
  s.release("c")
  assert s.acquire("a") == 1 and s.take_loads() == [(2, "c")]  # a was still resident
  s.acquire("b")  # replaces c, the least recently used idle one
  assert s.take_loads() == [(2, "b")]
  with pytest.raises(RuntimeError, match="released more often"):
    s.release("c")
  failed = []
  s.release("b")
  s.acquire("d")

  def boom(loads):
    failed.extend(loads)
    raise OSError("device lost")

  with pytest.raises(OSError):
    s.load_pending(boom)
  assert s.take_loads() == failed == [(2, "d")]  # queued again for the next step


def test_the_simulator_reads_each_distinct_adapter_once_per_step():
  """Four requests of one adapter cost one adapter read per step; four adapters four."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.costmodel.lora import LoraCost
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  cost = LoraCost(bytes_per_value=2.0, read_bytes_per_s=1e9, flops_per_s=1e15,
                  link_bytes_per_s=1e9)
  base = AffineStepModel(fixed_s=1e-3, per_token_s=0.0, per_pair_s=0.0)

  def itl(names):
    ex = SimExecutor(base, num_pages=256, page_size=16, max_loras=4, lora_cost=cost,
                     lora_adapters={n: 1_000_000 for n in "abcd"})
    eng = Engine(ex, SchedulerConfig("chunked", 4, 256, 256),
                 buckets=BucketTable.default(256, 4, 8))
    reqs = [eng.add_request([1] * 8, SamplingParams(max_tokens=5, ignore_eos=True, lora=n),
                            arrival_time=0.0) for n in names]
    eng.run()
    assert eng.scheduler.adapters.num_loads == len({n for n in names if n})
    return np.median([x for r in reqs for x in r.itls])

  read = 1_000_000 * 2.0 / 1e9  # one adapter's bytes at 1 GB/s
  assert itl([None] * 4) == pytest.approx(1e-3, rel=1e-6)
  assert itl(["a"] * 4) == pytest.approx(1e-3 + read, rel=1e-3)
  assert itl(list("abcd")) == pytest.approx(1e-3 + 4 * read, rel=1e-3)


def test_plan_lora_prints_adapter_bytes_next_to_the_model(tmp_path):
  import subprocess
  import sys
  from experiments.common import ROOT
  out = subprocess.run([sys.executable, "-m", "experiments.plan", "lora", "--model=qwen3-8b",
                        "--rank=16", "--targets=q,v", "--num_adapters=100", "--json"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  got = json.loads(out)
  # Qwen3-8B: 36 layers; q: 4096 -> 32 x 128, v: 4096 -> 8 x 128; bf16
  one = 36 * 16 * ((4096 + 4096) + (4096 + 1024)) * 2
  assert got["adapter_mib"] == pytest.approx(one / 2**20)
  assert got["all_adapters_mib"] == pytest.approx(100 * one / 2**20)
  assert 0.0009 < got["adapter_share_of_weights"] < 0.0011  # of ~14.4 GiB of matrices
  ms = [r["round_ms"] for r in got["rounds"]]
  assert ms == sorted(ms) and ms[0] > got["round_ms_base"]


def _cli_cmd():
  import sys
  return [sys.executable, "-m", "jaxinfer", "generate", "--warmup=false", "--max_tokens=6",
          "--prompt=" + PROMPTS[0], "--json", "--max_num_seqs=4",
          "--max_num_batched_tokens=32", "--num_pages=256"]


def test_cli_checks_lora_flags_before_loading(adapters):
  import subprocess
  from experiments.common import ROOT
  cmd = _cli_cmd()
  for bad, msg in ((["--lora=A"], "expected NAME=PEFT_DIR"),
                   ([f"--lora=A={adapters['A']}", "--lora_name=B"], "no such --lora"),
                   (["--lora=A=/nonexistent"], "is not a directory")):
    p = subprocess.run(cmd + bad, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and msg in p.stderr, p.stderr


# The server's adapter test (test_server.py) covers serving an adapter by name in the
# default suite; the CLI's own generate under an adapter loads and compiles SmolLM2 again.
@pytest.mark.slow
def test_cli_generates_under_an_adapter(lora_llm, adapters):
  import subprocess
  from experiments.common import ROOT
  cmd = _cli_cmd()
  p = subprocess.run(cmd + [f"--lora=A={adapters['A']}", f"--lora=B={adapters['B']}",
                            "--lora_name=B"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr
  got = json.loads(p.stdout.strip().splitlines()[-1])
  want = lora_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, lora="B"))[0]
  assert got["token_ids"] == want.token_ids


@pytest.mark.slow
def test_train_lora_teaches_a_behaviour_saved_in_peft_format(tmp_path):
  """tools/train_lora.py's loop on a tiny random Qwen3 (SmolLM2's backward compiles in
  ~130 s here; the tool's own run on it is in the README): two prompts that must be
  answered with a fixed reply. The answer NLL falls, the adapter saves as PEFT, loads in
  the engine, and the reply comes out of it, while the base model says something else."""
  import sys
  import jax
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
  import train_lora
  from jaxinfer.config import ModelConfig
  from jaxinfer.loading.registry import LoadedModel
  from jaxinfer.model.params import init_params
  cfg = ModelConfig(name="tiny-qwen3", family="qwen3", vocab_size=96, hidden_size=64,
                    intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=True,
                    max_position=256, qk_norm=True)
  model = LoadedModel(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2), None, "random")
  reply = [7, 11, 13, 17, 19, 23]
  prompts = [[1, 40, 41, 42, 2], [1, 50, 51, 2]]
  examples = [(p + reply, [0] * len(p) + [1] * len(reply)) for p in prompts]
  factors, hist = train_lora.train(model, examples, targets=("wq", "wv", "w_down"), rank=4,
                                   alpha=8.0, batch=2, steps=40, lr=2e-2, seed=0, log_every=1)
  assert hist[-1][1] < 0.05 * hist[0][1], hist
  path = str(tmp_path / "reply")
  save_peft(path, {t: np.asarray(v) for t, v in factors["a"].items()},
            {t: np.asarray(v) for t, v in factors["b"].items()}, cfg, rank=4, alpha=8.0)
  llm = LLM(model, warmup=False, max_num_seqs=2, max_num_batched_tokens=32, num_pages=64,
            lora_adapters={"reply": path})
  sp = SamplingParams(max_tokens=len(reply), ignore_eos=True)
  for p in prompts:
    tuned = llm.generate([p], SamplingParams(max_tokens=len(reply), ignore_eos=True,
                                             lora="reply"))[0]
    assert tuned.token_ids == reply
    assert llm.generate([p], sp)[0].token_ids != reply


@pytest.mark.slow
def test_lora_study_small(tmp_path):
  """experiments.lora at CI size: real and simulated rows for k = 0, 1, 4 distinct
  adapters; simulated throughput falls as adapters are added (each is read once per
  step), the real run loads each adapter once."""
  import subprocess
  import sys
  from experiments.common import ROOT
  p = subprocess.run([sys.executable, "-m", "experiments.lora", "--small", "--json",
                      f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  got = json.loads(p.stdout[p.stdout.index("{"):])
  sim = got["simulated"]["rows"]
  assert [r["distinct"] for r in sim] == [0, 1, 4]
  tps = [r["tokens_per_s"] for r in sim]
  assert tps[0] > tps[1] > tps[2]
  real = got["real"]["rows"]
  assert [r["adapter_loads"] for r in real] == [0, 1, 4]
  assert all(r["tokens_per_s"] > 0 for r in real)
  assert os.path.isfile(tmp_path / "lora.png")


@pytest.mark.slow
def test_a_warm_engine_with_adapters_never_recompiles(smollm2, adapters):
  """Warm-up compiles each shape's adapter-carrying variant too (dense decode, segment
  prefill); then base and adapter requests of any mix compile nothing."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.step import num_compiled_steps
  table = BucketTable(token_sizes=(4, 16), request_sizes=(4,), page_table_sizes=(8,),
                      prefill_slot_sizes=(1, 2, 4))  # 9 shapes, each plain and with LoRA
  llm = LLM(smollm2, buckets=table, num_pages=128, lora_adapters=adapters, max_loras=2)
  before = num_compiled_steps()
  rng = np.random.default_rng(0)
  for i in range(8):
    llm.engine.add_request(rng.integers(100, 40000, int(rng.integers(2, 30))).tolist(),
                           SamplingParams(max_tokens=int(rng.integers(1, 6)), ignore_eos=True,
                                          lora=[None, "A", "B", "C"][i % 4]))
    llm.engine.step()
  llm.engine.run()
  assert llm.engine.scheduler.adapters.num_loads >= 3
  assert num_compiled_steps() == before, "a warm engine with adapters compiled a shape"


@pytest.mark.slow
def test_speculative_decoding_under_an_adapter_equals_plain(smollm2, lora_llm, adapters):
  """n-gram and early-exit drafts (drafted without the adapter) are verified by the
  adapted target: the greedy output equals plain decoding under the same adapter."""
  prompt = "Count with me: one, two, three, four, one, two, three, four, one, two,"
  want = lora_llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True,
                                                    lora="A"))[0].token_ids
  for kind in ("ngram", "early_exit"):
    spec = LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=32,
               num_pages=256, lora_adapters={"A": adapters["A"]}, speculative=kind,
               num_draft=3)
    got = spec.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True,
                                                 lora="A"))[0]
    assert got.token_ids == want, kind
    assert got.rounds > 0
