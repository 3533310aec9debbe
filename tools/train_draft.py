"""Train a small draft model by distilling the target's next-token distribution on text
the target generates (8.5.3), with optax; checkpointed with orbax so that
`--speculative=draft_model --draft_model=<dir>` can load it.

  python tools/train_draft.py --output=out/smollm2-draft --steps=300
"""
from __future__ import annotations

import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m-instruct", "target model (teacher)")
flags.DEFINE_string("output", "out/smollm2-draft", "checkpoint directory")
flags.DEFINE_integer("layers", 2, "draft layers")
flags.DEFINE_integer("hidden", 0, "draft hidden size (0: the target's, whose embedding table "
                     "then initializes the draft's)")
flags.DEFINE_integer("heads", 0, "draft query heads (0: the target's)")
flags.DEFINE_integer("kv_heads", 0, "draft KV heads (0: the target's)")
flags.DEFINE_integer("intermediate", 768, "draft FFN size")
flags.DEFINE_integer("num_texts", 32, "texts the target generates as training data")
flags.DEFINE_integer("text_tokens", 96, "tokens generated per text")
flags.DEFINE_integer("seq_len", 64, "training window")
flags.DEFINE_integer("batch", 8, "windows per step")
flags.DEFINE_integer("steps", 300, "optimizer steps")
flags.DEFINE_float("lr", 3e-3, "Adam learning rate")
flags.DEFINE_integer("seed", 0, "seed")

PROMPTS = ["Tell me about the ocean.", "Explain how a bicycle works.", "Write a recipe for soup.",
           "Describe a city at night.", "What is photosynthesis?",
           "Give advice for a job interview.", "Summarize the history of writing.",
           "Write a letter to a friend."]


def _batch_inputs(B, T, page_size=16):
  """Metadata for B requests prefilling T tokens each from empty caches."""
  from jaxinfer.runtime.batcher import SeqWork, pack_exact
  pages = -(-T // page_size)
  works = [SeqWork([0] * T, 0, list(range(i * pages, (i + 1) * pages)), num_logits=0)
           for i in range(B)]
  step = pack_exact(works, page_size, B * pages)
  return step.arrays, step.bucket.attn_shape, B * pages


def distill_loss(params, teacher_logp, tokens, meta, pool, cfg, attn_shape):
  from jaxinfer.model import transformer
  batch = dict(meta, token_ids=tokens)
  # The reference attention: differentiable (the xla backend's page-block loop has a
  # data-dependent trip count, which reverse mode cannot go through).
  x, _, _ = transformer.hidden_states(params, pool, batch, cfg, attn_shape=attn_shape,
                                      backend="reference")
  logp = jax.nn.log_softmax(transformer.lm_head(params, x, cfg), axis=-1)  # [B*T, V]
  return jnp.mean(jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - logp), axis=-1))


def train(target, student_cfg, data, *, seq_len, batch, steps, lr, seed, log_every=25):
  """Returns (student params, [(step, loss)])."""
  import optax
  from jaxinfer.kv import allocate_pool
  from jaxinfer.model import init_params, stack_layers, transformer
  meta, attn_shape, num_pages = _batch_inputs(batch, seq_len)
  meta = {k: jnp.asarray(v) for k, v in meta.items() if k != "token_ids"}
  t_pool = allocate_pool(target.cfg, "f32", num_pages, 16)
  s_pool = allocate_pool(student_cfg, "f32", num_pages, 16)
  teacher = jax.jit(lambda tok: jax.nn.log_softmax(transformer.lm_head(
      target.params, transformer.hidden_states(target.params, t_pool, dict(meta, token_ids=tok),
                                               target.cfg, attn_shape=attn_shape)[0],
      target.cfg), axis=-1))
  params = init_params(student_cfg, jax.random.key(seed))
  if student_cfg.hidden_size == target.cfg.hidden_size:  # same vocabulary and width
    params["embed"] = jnp.asarray(target.params["embed"])
  params = stack_layers(params)
  opt = optax.adam(lr)
  state = opt.init(params)

  @jax.jit
  def update(params, state, tok, tlogp):
    loss, g = jax.value_and_grad(distill_loss)(params, tlogp, tok, meta, s_pool, student_cfg,
                                               attn_shape)
    upd, state = opt.update(g, state, params)
    return optax.apply_updates(params, upd), state, loss

  rng = np.random.default_rng(seed)
  starts = np.arange(0, len(data) - seq_len)
  history = []
  for step in range(steps):
    idx = rng.choice(starts, batch)
    tok = jnp.asarray(np.concatenate([data[i:i + seq_len] for i in idx]), jnp.int32)
    params, state, loss = update(params, state, tok, teacher(tok))
    if step % log_every == 0 or step == steps - 1:
      history.append((step, float(loss)))
  return params, history


def main(argv):
  del argv
  from jaxinfer.config import ModelConfig, SamplingParams
  from jaxinfer.llm import LLM
  from jaxinfer.loading.checkpoint import save_checkpoint
  llm = LLM(FLAGS.target)
  t = llm.cfg
  hidden = FLAGS.hidden or t.hidden_size
  heads = FLAGS.heads or t.num_heads
  cfg = ModelConfig(name=os.path.basename(FLAGS.output.rstrip("/")), family="llama",
                    vocab_size=t.vocab_size, hidden_size=hidden,
                    intermediate_size=FLAGS.intermediate, num_layers=FLAGS.layers,
                    num_heads=heads, num_kv_heads=FLAGS.kv_heads or t.num_kv_heads,
                    head_dim=hidden // heads, rope_theta=t.rope_theta,
                    rms_norm_eps=t.rms_norm_eps, tie_embeddings=True, max_position=t.max_position,
                    bos_token_id=t.bos_token_id, eos_token_ids=t.eos_token_ids)
  t0 = time.perf_counter()
  prompts = [PROMPTS[i % len(PROMPTS)] for i in range(FLAGS.num_texts)]
  sps = [SamplingParams(max_tokens=FLAGS.text_tokens, temperature=0.8, seed=i, ignore_eos=True)
         for i in range(len(prompts))]
  outs = llm.generate(prompts, sps, chat=True)
  data = np.concatenate([np.array(o.prompt_token_ids + o.token_ids) for o in outs])
  print(f"generated {len(data)} tokens of training text in {time.perf_counter() - t0:.1f}s")
  params, history = train(llm.model, cfg, data, seq_len=FLAGS.seq_len, batch=FLAGS.batch,
                          steps=FLAGS.steps, lr=FLAGS.lr, seed=FLAGS.seed)
  for step, loss in history:
    print(f"step {step:5d}  KL(target || draft) {loss:.4f}")
  save_checkpoint(FLAGS.output, params, cfg, tokenizer_source=llm.model.source)
  print(f"saved {cfg.param_count() / 1e6:.1f}M-parameter draft model to {FLAGS.output}")


if __name__ == "__main__":
  app.run(main)
