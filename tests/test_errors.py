"""Bad input gets a clear error naming the value and the limit."""
import os
import re

import numpy as np
import pytest

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams, get_model_config
from jaxinfer.loading import ModelLoadError, load_model, resolve_model


def test_unknown_model_name():
  with pytest.raises(ModelLoadError, match="unknown model 'llama-9000'"):
    resolve_model("llama-9000")
  with pytest.raises(ValueError, match="unknown model 'nope'"):
    get_model_config("nope")


def test_known_config_without_weights():
  with pytest.raises(ModelLoadError, match="no bundled weights"):
    resolve_model("qwen3-8b")


def test_malformed_gguf(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + os.urandom(64))
  with pytest.raises(ModelLoadError, match="not a readable GGUF"):
    load_model(str(bad), use_cache=False)


def test_missing_gguf(tmp_path):
  from jaxinfer.loading.gguf_loader import open_gguf
  with pytest.raises(ModelLoadError, match="not found"):
    open_gguf(str(tmp_path / "missing.gguf"))


def test_unsupported_architecture(tmp_path):
  import gguf
  path = str(tmp_path / "mamba.gguf")
  w = gguf.GGUFWriter(path, "mamba")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 4), "float32"))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
    load_model(path, use_cache=False)


def test_unsupported_hf_architecture(tmp_path):
  (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
  with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
    load_model(str(tmp_path))


def test_bad_sampling_params():
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1)
  with pytest.raises(ValueError, match="max_tokens"):
    SamplingParams(max_tokens=0)


@pytest.mark.parametrize("kw,words", [
    (dict(seed=1.5), "seed must be an integer, got 1.5"),
    (dict(seed=2**64), "seed must be in"),
    (dict(top_k=2**40), "top_k must be in [0, 2147483647], got 1099511627776"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=float("inf")), "top_p must be a finite number in (0.0, 1.0]"),
    (dict(max_tokens=2**31), "max_tokens must be in [1, 2147483647]"),
    (dict(stop=("",)), "stop strings must be non-empty"),
    (dict(stop=("ok", 3)), "got 3"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids[] must be in [0, 2147483647], got -1"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool"),
])
def test_sampling_params_name_field_value_and_limit(kw, words):
  """Found by probing: these passed validation and failed inside a step (or ran as
  greedy, for NaN), poisoning the engine."""
  with pytest.raises(ValueError) as e:
    SamplingParams(**kw)
  assert words in str(e.value)


def test_one_stop_string_is_one_stop():
  assert SamplingParams(stop="Paris").stop == ("Paris",)  # not five one-letter stops
  assert SamplingParams(seed=-3).seed == -3  # keyed by seed mod 2**32


def test_bucket_overflow_is_an_error():
  from jaxinfer.buckets import BucketError, BucketTable
  t = BucketTable.default(max_tokens=64, max_requests=4, max_pages=8)
  with pytest.raises(BucketError, match="tokens per step=65 exceeds the largest bucket 64"):
    t.select(65, 1, 1)
  with pytest.raises(BucketError, match="requests per step=5"):
    t.select(5, 5, 1)


def test_prompt_ids_outside_the_vocabulary_are_rejected_before_queueing():
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  ex = SimExecutor(AffineStepModel(), num_pages=16, page_size=4)
  ex.vocab_size = 100
  eng = Engine(ex, buckets=BucketTable.default(max_tokens=16, max_requests=2, max_pages=8))
  for ids, words in [([5, 100], "prompt_token_ids[1] = 100 is outside the vocabulary [0, 100)"),
                     ([-1], "prompt_token_ids[0] = -1"), ([2**31], "outside"),
                     ([1.0], "must be an integer"), ("hello", "not text")]:
    with pytest.raises(ValueError, match=re.escape(words)):
      eng.add_request(ids, SamplingParams(max_tokens=2))
  from jaxinfer.runtime.engine import RequestTooLargeError
  with pytest.raises(ValueError, match="the prompt is empty") as e:
    eng.add_request([], SamplingParams(max_tokens=2))
  assert not isinstance(e.value, RequestTooLargeError)  # nothing is too large there
  assert not eng.requests and not eng.scheduler.waiting  # nothing was queued
  eng.add_request([5, 99], SamplingParams(max_tokens=2))
  assert len(list(eng.stream())) == 2


def _cli(*args, env=None):
  import subprocess
  import sys
  return subprocess.run([sys.executable, "-m", "jaxinfer", *args], capture_output=True,
                        timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)),
                        env=None if env is None else {**os.environ, **env})


def test_cli_help_lists_the_flags_and_exits_0():
  for args in (["--help"], ["generate", "--help"]):
    out = _cli(*args)
    assert out.returncode == 0
    text = out.stdout.decode()
    for flag in ("--kv_format", "--attention", "--max_tokens", "--speculative"):
      assert flag in text


@pytest.mark.parametrize("args,words", [
    (["generate", "--temperature=nan"], "temperature must be a finite number"),
    (["generate", "--top_k=-1"], "top_k must be in [0, 2147483647], got -1"),
    (["generate", "--kv_format=bogus"], "value should be one of <f32|bf16|fp8|q8_0|q4_0>"),
    (["generate", "--num_pages=-1"], "--num_pages must be 0 (auto) or >= 1, got -1"),
    (["generate", "extra"], "unexpected arguments"),
    ([], "usage: python -m jaxinfer generate"),
    (["generate", b"--prompt=a\xffb"], "not valid UTF-8"),
])
def test_cli_argument_errors_are_one_line_and_exit_2_before_loading(args, words, tmp_path):
  out = _cli(*args, env={"JAXINFER_CACHE": str(tmp_path)})
  err = out.stderr.decode().strip()
  assert out.returncode == 2, err
  assert err.startswith("error: ") and words in err and "\n" not in err
  assert not list(tmp_path.iterdir())  # no model was loaded (a load converts into the cache)


def test_cli_bucket_table_of_scalars_is_a_usage_error(tmp_path):
  table = tmp_path / "t.json"
  table.write_text('{"token_sizes": [16], "request_sizes": 4, "page_table_sizes": [8]}')
  out = _cli("generate", f"--buckets={table}", env={"JAXINFER_CACHE": str(tmp_path / "c")})
  err = out.stderr.decode().strip()
  assert out.returncode == 2, err
  assert err == f"error: --buckets={table}: request_sizes must be a list of integers, got 4"


def test_cli_generate_exits_1_and_says_why_when_a_request_fails(smollm2, tmp_path):
  """An adapter of finite weights that overflow at run time: the request ends with
  `error`; plain and --stream runs both say so on stderr and exit 1."""
  from jaxinfer.lora import save_peft
  from jaxinfer.lora.adapter import random_adapter_factors
  a, b = random_adapter_factors(smollm2.cfg, 4, ("wq",), seed=5)
  a["wq"] = np.sign(a["wq"]) * np.float32(3e38)
  save_peft(str(tmp_path / "X"), a, b, smollm2.cfg, rank=4, alpha=4)
  base = ["generate", f"--lora=X={tmp_path / 'X'}", "--lora_name=X", "--max_tokens=3",
          "--nowarmup", "--max_lora_rank=4", "--num_pages=64", "--max_num_seqs=1",
          "--max_num_batched_tokens=32"]
  for extra in ([], ["--stream"]):  # --json prints its line, then the same exit path
    out = _cli(*base, *extra)
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert "non-finite logits" in err.splitlines()[-1], err


def test_request_fields_and_llm_sizes_are_checked_before_anything_changes():
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.llm import LLM
  from jaxinfer.runtime.engine import Engine
  eng = Engine(SimExecutor(AffineStepModel(), num_pages=16, page_size=4),
               buckets=BucketTable.default(max_tokens=16, max_requests=2, max_pages=8))
  sp = SamplingParams(max_tokens=2)
  for kw, words in [(dict(priority=None), "priority must be an integer"),
                    (dict(arrival_time=float("nan")), "arrival_time must be a finite"),
                    (dict(deadline_s=float("inf")), "deadline_s must be a finite"),
                    (dict(deadline_s=0.0), "deadline_s must be > 0")]:
    with pytest.raises(ValueError, match=words):
      eng.add_request([1, 2], sp, **kw)
  assert not eng.requests and not eng.scheduler.has_work()
  for kw, words in [(dict(page_size=0), "page_size must be an integer >= 1, got 0"),
                    (dict(num_pages=-3), "num_pages must be"),
                    (dict(max_model_len=1), "max_model_len must be"),
                    (dict(cache_eviction="fifo"),
                     r"cache_eviction must be one of \('lru', 'value'\), got 'fifo'"),
                    (dict(host_cache_pages=-1), "host_cache_pages must be an integer >= 0"),
                    (dict(buckets="/no/such/table.json"), "No such file")]:
    with pytest.raises((ValueError, OSError), match=words):
      LLM("no-such-model-is-loaded", warmup=False, **kw)  # fails before any load is tried


def test_lone_surrogate_prompt_is_a_clear_error(smollm2):
  from jaxinfer.llm import LLM
  table = BucketTable(token_sizes=(8,), request_sizes=(1,), page_table_sizes=(4,))
  llm = LLM.from_loaded(smollm2, warmup=False, num_pages=8, buckets=table)
  with pytest.raises(ValueError, match="not valid Unicode"):
    llm.generate(["caf\udce9"], SamplingParams(max_tokens=2))
  assert not llm.engine.has_unfinished()


def test_cache_list_and_clear(tmp_path):
  entry = tmp_path / "abc123"
  entry.mkdir()
  (entry / "model_config.json").write_text('{"name": "tiny"}')
  (tmp_path / "xla").mkdir()
  (tmp_path / "xla" / "blob").write_bytes(b"x" * 4096)
  env = {"JAXINFER_CACHE": str(tmp_path)}
  out = _cli("cache", "list", env=env)
  assert out.returncode == 0
  text = out.stdout.decode()
  assert "converted weights of tiny" in text and "compiled steps" in text
  out = _cli("cache", "clear", env=env)
  assert out.returncode == 0 and "removed 2 entries" in out.stdout.decode()
  assert not list(tmp_path.iterdir())
