"""tools/train_draft.py: distillation lowers KL(target || draft); the orbax checkpoint
loads as a draft model whose speculative output equals plain greedy."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))


@pytest.mark.slow
def test_distill_save_load_and_draft(smollm2, tmp_path):
  import train_draft
  from jaxinfer.config import ModelConfig, SamplingParams
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  from jaxinfer.loading.checkpoint import save_checkpoint
  t = smollm2.cfg
  cfg = ModelConfig(name="tiny-draft", family="llama", vocab_size=t.vocab_size,
                    hidden_size=t.hidden_size, intermediate_size=256, num_layers=1,
                    num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                    rope_theta=t.rope_theta, rms_norm_eps=t.rms_norm_eps, tie_embeddings=True,
                    max_position=t.max_position, eos_token_ids=t.eos_token_ids)
  tok = smollm2.tokenizer
  data = np.array(tok.encode("The sun rises in the east and sets in the west. " * 20))
  params, hist = train_draft.train(smollm2, cfg, data, seq_len=32, batch=2, steps=12, lr=3e-3,
                                   seed=0, log_every=1)
  assert hist[-1][1] < 0.5 * hist[0][1]
  path = str(tmp_path / "draft")
  save_checkpoint(path, params, cfg, tokenizer_source=smollm2.source)
  draft = load_model(path)
  assert draft.cfg.num_layers == 1 and draft.tokenizer is not None
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  prompt = "The sun rises in the east and sets in the"
  plain = LLM.from_loaded(smollm2, warmup=False, num_pages=64).generate([prompt], sp)[0].token_ids
  spec = LLM.from_loaded(smollm2, warmup=False, num_pages=64, speculative="draft_model",
                         draft_model=draft, num_draft=3).generate([prompt], sp)[0]
  assert spec.token_ids == plain and spec.rounds > 0
