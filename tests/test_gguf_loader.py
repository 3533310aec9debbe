"""GGUF loading: every supported tensor type, and the llama Q/K row permutation undone."""
import numpy as np
import pytest

from jaxinfer.loading import ModelLoadError, gguf_loader

D, N, K, H, F, V, L = 64, 4, 2, 16, 96, 128, 2


def _permute(w, n_head):
  """What llama.cpp's converter does to HF q/k rows for its pairwise RoPE."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def write_llama_gguf(path, qtype="F32", seed=0):
  import gguf
  from gguf import quants
  rng = np.random.default_rng(seed)
  hf = {"embed": rng.standard_normal((V, D)).astype(np.float32),
        "norm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(L)
  w.add_context_length(256)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(N)
  w.add_head_count_kv(K)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(V)
  t = gguf.GGMLQuantizationType[qtype]

  def add(name, arr):
    if arr.ndim == 2 and qtype != "F32":
      w.add_tensor(name, quants.quantize(arr, t), raw_dtype=t)
    else:
      w.add_tensor(name, arr)

  add("token_embd.weight", hf["embed"])
  w.add_tensor("output_norm.weight", hf["norm"])
  for i in range(L):
    lay = {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in
           [("q", (N * H, D)), ("k", (K * H, D)), ("v", (K * H, D)), ("o", (D, N * H)),
            ("gate", (F, D)), ("up", (F, D)), ("down", (D, F))]}
    hf[i] = lay
    add(f"blk.{i}.attn_q.weight", _permute(lay["q"], N))
    add(f"blk.{i}.attn_k.weight", _permute(lay["k"], K))
    add(f"blk.{i}.attn_v.weight", lay["v"])
    add(f"blk.{i}.attn_output.weight", lay["o"])
    add(f"blk.{i}.ffn_gate.weight", lay["gate"])
    add(f"blk.{i}.ffn_up.weight", lay["up"])
    add(f"blk.{i}.ffn_down.weight", lay["down"])
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(D, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(D, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return hf


@pytest.mark.parametrize("qtype,tol", [("F32", 0), ("F16", 2e-3), ("BF16", 1e-2),
                                       ("Q8_0", 1e-2), ("Q4_0", 0.2), ("Q4_1", 0.2)])
def test_tensor_types_and_unpermute(tmp_path, qtype, tol):
  path = str(tmp_path / f"tiny-{qtype}.gguf")
  hf = write_llama_gguf(path, qtype)
  params, cfg, _ = gguf_loader.load_gguf(path)
  assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (L, N, K, H)
  assert cfg.tie_embeddings
  for i in range(L):
    got = params["layers"][i]
    for ours, theirs in [("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"), ("w_gate", "gate"),
                         ("w_down", "down")]:
      ref = hf[i][theirs].T  # [in, out]
      err = np.abs(got[ours] - ref).max() / np.abs(ref).max()
      assert err <= tol + 1e-7, (qtype, ours, err)


def test_unsupported_tensor_type_is_named(tmp_path, monkeypatch):
  path = str(tmp_path / "tiny.gguf")
  write_llama_gguf(path, "Q8_0")
  from gguf import quants

  def refuse(data, qtype):
    raise NotImplementedError(qtype)

  monkeypatch.setattr(quants, "dequantize", refuse)
  with pytest.raises(ModelLoadError, match="has type Q8_0.*re-export"):
    gguf_loader.load_gguf(path)


@pytest.fixture
def no_tokenizer(monkeypatch):
  """The tiny test GGUF carries no tokenizer: load it with none."""
  from jaxinfer.loading import tokenizer
  monkeypatch.setattr(tokenizer, "tokenizer_from_gguf", lambda reader: None)


def test_weights_with_nan_are_rejected_naming_the_tensor(tmp_path, no_tokenizer):
  """A damaged file produced NaN logits and all-zero tokens with exit code 0."""
  import gguf
  from jaxinfer.loading import load_model
  path = str(tmp_path / "tiny.gguf")
  write_llama_gguf(path, "F32")
  t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
  with open(path, "r+b") as f:
    f.seek(t.data_offset + 40)
    f.write(np.full(8, np.nan, np.float32).tobytes())
  with pytest.raises(ModelLoadError, match=r"weight .*up.* holds NaN or Inf"):
    load_model(path, cache_dir=str(tmp_path / "cache"))
  # checked before the cache is written: a restore trusts the cache's checksum alone
  assert not list((tmp_path / "cache").rglob("params.*"))


def test_damaged_converted_cache_is_converted_again(tmp_path, caplog, no_tokenizer):
  """Truncated or overwritten tensor data in the converted-weight cache: a warning and a
  fresh conversion (the user was stuck until they deleted the entry by hand)."""
  import os
  from jaxinfer.loading import load_model
  path = str(tmp_path / "tiny.gguf")
  write_llama_gguf(path, "F32")
  cache = tmp_path / "cache"
  want = load_model(path, cache_dir=str(cache))
  files = sorted((p for p in cache.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
  with open(files[0], "r+b") as f:  # the largest data file: cut it in half
    f.truncate(os.path.getsize(files[0]) // 2)
  got = load_model(path, cache_dir=str(cache))
  assert "converting again" in caplog.text
  import jax
  for a, b in zip(jax.tree_util.tree_leaves(want.params), jax.tree_util.tree_leaves(got.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_converted_cache_is_keyed_by_content_and_shared_by_concurrent_loads(tmp_path,
                                                                           no_tokenizer):
  """Two copies of one GGUF share a cache entry (the key held the absolute path and
  mtime: every venv added a copy); two processes converting at once both succeed (one
  crashed on orbax's 'Configuration mismatch'); no temporary directory is left."""
  import os
  import shutil
  import subprocess
  import sys
  a = str(tmp_path / "a" / "tiny.gguf")
  os.makedirs(os.path.dirname(a))
  write_llama_gguf(a, "F32")
  b = str(tmp_path / "b.gguf")
  shutil.copy(a, b)
  cache = tmp_path / "cache"
  code = ("import sys\n"
          "from jaxinfer.loading import tokenizer, load_model\n"
          "tokenizer.tokenizer_from_gguf = lambda reader: None\n"
          f"load_model(sys.argv[1], cache_dir={str(cache)!r})\n"
          "print('ok')\n")
  procs = [subprocess.Popen([sys.executable, "-c", code, p], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for p in (a, b)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
  entries = [p.name for p in cache.iterdir()]
  assert len(entries) == 1 and not entries[0].startswith("."), entries


def test_flipped_bytes_in_the_converted_cache_are_caught_by_the_checksum(tmp_path, caplog,
                                                                        no_tokenizer):
  """Overwritten bytes that still decode as finite numbers: the stored checksum catches
  them, the entry is converted again and the weights equal the file's."""
  from jaxinfer.loading import load_model
  import jax
  path = str(tmp_path / "tiny.gguf")
  write_llama_gguf(path, "F32")
  cache = tmp_path / "cache"
  want = load_model(path, cache_dir=str(cache))
  data = max((p for p in cache.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(range(64))
  data.write_bytes(bytes(raw))
  got = load_model(path, cache_dir=str(cache))
  assert "converting again" in caplog.text, caplog.text[-2000:]
  for a, b in zip(jax.tree_util.tree_leaves(want.params), jax.tree_util.tree_leaves(got.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16 has no buffer format
def test_checkpoint_restore_verifies_its_checksum(tmp_path, dtype):
  import jax
  from jaxinfer.config import SMOLLM2_135M
  from jaxinfer.loading import checkpoint
  from jaxinfer.model.params import init_params
  cfg = SMOLLM2_135M.replace(num_layers=2, hidden_size=64, intermediate_size=128,
                             num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)
  params = init_params(cfg, jax.random.PRNGKey(1), dtype=jax.numpy.dtype(dtype))
  d = str(tmp_path / "ck")
  checkpoint.save_checkpoint(d, params, cfg)
  got, _ = checkpoint.restore_checkpoint(d, jax.numpy.dtype(dtype))  # intact: restores
  np.testing.assert_array_equal(np.asarray(got["embed"]), np.asarray(params["embed"]))
  import json
  rec = json.loads((tmp_path / "ck" / "checksum").read_text())
  assert rec["dtype"] == dtype
  bad = dict(rec, params_crc32=f"{int(rec['params_crc32'], 16) ^ 1:08x}")
  (tmp_path / "ck" / "checksum").write_text(json.dumps(bad))
  with pytest.raises(ModelLoadError, match="is damaged: its weights' checksum"):
    checkpoint.restore_checkpoint(d, jax.numpy.dtype(dtype))
  (tmp_path / "ck" / "checksum").write_text(json.dumps(rec))
  conf = tmp_path / "ck" / "model_config.json"
  conf.write_text(conf.read_text().replace('"rope_theta": 100000.0', '"rope_theta": 5.0'))
  with pytest.raises(ModelLoadError, match="model_config.json changed since"):
    checkpoint.restore_checkpoint(d, jax.numpy.dtype(dtype))


def test_converted_cache_entry_with_an_edited_config_or_no_checksum_is_rebuilt(
    tmp_path, caplog, no_tokenizer):
  """The entry's checksum covers model_config.json and every tensor: an edited config
  (rope_theta), a deleted, garbled or config-less checksum each mean a fresh conversion,
  never an entry trusted as it is."""
  import json
  import jax
  from jaxinfer.loading import load_model
  path = str(tmp_path / "tiny.gguf")
  write_llama_gguf(path, "F32")
  cache = tmp_path / "cache"
  want = load_model(path, cache_dir=str(cache))
  (entry,) = [p for p in cache.iterdir()]
  rec = json.loads((entry / "checksum").read_text())

  def edit_config():
    c = json.loads((entry / "model_config.json").read_text())
    (entry / "model_config.json").write_text(json.dumps(dict(c, rope_theta=12.5)))

  damages = [edit_config, lambda: (entry / "checksum").unlink(),
             lambda: (entry / "checksum").write_text("{not json"),
             lambda: (entry / "checksum").write_text(f"{rec['params_crc32']} {rec['dtype']}")]
  for damage in damages:
    caplog.clear()
    damage()
    got = load_model(path, cache_dir=str(cache))
    assert "converting again" in caplog.text, (damage, caplog.text[-2000:])
    assert got.cfg == want.cfg
    for a, b in zip(jax.tree_util.tree_leaves(want.params),
                    jax.tree_util.tree_leaves(got.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    caplog.clear()
    load_model(path, cache_dir=str(cache))  # the rebuilt entry is trusted again
    assert "converting again" not in caplog.text


def test_a_warm_load_reads_the_cached_tokenizer_and_a_damaged_one_is_rebuilt(caplog):
  """SmolLM2's GGUF loaded again (the run's cache holds its converted weights): the load
  takes its tokenizer from the entry beside the weights without opening the GGUF's
  metadata, and encodes alike; an edited tokenizer.json (its SHA-256 no longer matches)
  is refused with a warning, read from the GGUF again and rewritten."""
  import pathlib
  from jaxinfer.loading import gguf_loader, load_model, resolve_model
  from jaxinfer.loading.registry import cache_key, default_cache_dir
  first = load_model("smollm2-135m-instruct")
  tok_dir = pathlib.Path(default_cache_dir()) / (
      cache_key(resolve_model("smollm2-135m-instruct"), "float32") + ".tokenizer")
  assert tok_dir.is_dir()
  opened = []
  real = gguf_loader.open_gguf

  def spy(path):
    opened.append(path)
    return real(path)

  gguf_loader.open_gguf = spy
  try:
    warm = load_model("smollm2-135m-instruct")
    assert not opened
    text = "Hello, world! 123 <|im_start|>"
    assert warm.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert warm.tokenizer.chat_template == first.tokenizer.chat_template
    with open(tok_dir / "tokenizer.json", "a") as f:
      f.write(" ")
    again = load_model("smollm2-135m-instruct")
    assert opened and "ignoring the cached tokenizer" in caplog.text
    assert again.tokenizer.encode(text) == first.tokenizer.encode(text)
  finally:
    gguf_loader.open_gguf = real
  from jaxinfer.loading import tokenizer as tok
  tok.load_saved(str(tok_dir))  # rewritten whole


def test_gguf_blocks_are_cached_and_a_damaged_entry_is_read_again(tmp_path, caplog,
                                                                  no_tokenizer, monkeypatch):
  """weight_format="gguf": the file's blocks are cached beside the converted weights, so a
  warm start parses none of the file; flipped bytes in the entry are caught by its CRC and
  the blocks are read from the file again."""
  from pallas_kernels.cpu import gguf as native_gguf
  if not native_gguf.available():
    pytest.skip("weight_format='gguf' needs the native CPU library")
  import jax
  from jaxinfer.loading import checkpoint, load_model
  path = str(tmp_path / "tiny.gguf")
  write_llama_gguf(path, "Q8_0")
  cache = tmp_path / "cache"
  want = load_model(path, cache_dir=str(cache), weight_format="gguf").params["blocks"]
  entries = [d for d in cache.iterdir() if (d / "checksum").is_file()
             and not checkpoint.is_checkpoint(str(d))]
  assert len(entries) == 1, list(cache.iterdir())

  def same(got):
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  real = gguf_loader.load_blocks
  monkeypatch.setattr(gguf_loader, "load_blocks", lambda *a: pytest.fail("file read again"))
  same(load_model(path, cache_dir=str(cache), weight_format="gguf").params["blocks"])
  monkeypatch.setattr(gguf_loader, "load_blocks", real)
  data = entries[0] / checkpoint.FLAT_DATA
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  data.write_bytes(bytes(raw))
  same(load_model(path, cache_dir=str(cache), weight_format="gguf").params["blocks"])
  assert "ignoring the cached GGUF blocks" in caplog.text and "is damaged" in caplog.text
