"""Train a LoRA adapter on SmolLM2 with optax and save it in PEFT's format (8.2.1).

  python tools/train_lora.py --output=out/lora-upper [--steps=60]

The behaviour taught: answer in upper case. Training data: the base model's own greedy
chat answers to a set of questions, upper-cased (so only the case changes, not what is
said). The base weights stay frozen; only the adapters' A and B of --targets train
(PEFT's initialisation: A uniform in +-1/sqrt(in), B zero, so step 0 is the base model),
with the loss on the answer tokens only. Then greedy answers to held-out questions are
printed with and without the adapter, with the share of their letters in upper case.
The saved directory loads in jaxinfer (`--lora upper=DIR`), in HF peft and in vLLM.
"""
from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

FLAGS = flags.FLAGS

QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "How do plants grow?",
    "What is a computer?", "Describe the moon.", "Why is the sky blue?",
    "What do cats eat?", "Give me a tip for studying.", "What is rain?",
    "How does a car work?", "Tell me about dogs.", "What is music?",
    "Describe a forest.", "What is the sun?", "How do birds fly?", "What is water made of?",
    "Describe winter.", "What is a book?", "Why do we sleep?", "What is a river?",
    "How do you make tea?", "What is a volcano?", "Describe the ocean.", "What is bread?"]
HELD_OUT = ["What is a mountain?", "How do fish breathe?", "Describe a city.",
            "What is chocolate?"]


def upper_share(text: str) -> float:
  letters = [c for c in text if c.isalpha()]
  return sum(c.isupper() for c in letters) / max(len(letters), 1)


def make_examples(llm, questions, answer_tokens: int):
  """(token ids, loss mask) per question: chat prompt + upper-cased base answer + EOS."""
  from jaxinfer.config import SamplingParams
  outs = llm.generate(questions, SamplingParams(max_tokens=answer_tokens), chat=True)
  eos = llm.tokenizer.eos_token_ids[0]
  examples = []
  for q, o in zip(questions, outs):
    prompt = llm.encode_prompt(q, chat=True)
    answer = llm.tokenizer.encode(o.text.strip().upper()) + [eos]
    examples.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
  return examples


def init_factors(cfg, targets, rank: int, seed: int):
  """PEFT's initialisation: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a=sqrt(5)),
  B = 0. a[t] [L, in, r], b[t] [L, r, out]."""
  from jaxinfer.lora.adapter import target_shape
  key = jax.random.key(seed)
  a, b = {}, {}
  for i, t in enumerate(targets):
    d_in, d_out = target_shape(cfg, t)
    bound = 1.0 / np.sqrt(d_in)
    a[t] = jax.random.uniform(jax.random.fold_in(key, i), (cfg.num_layers, d_in, rank),
                              jnp.float32, -bound, bound)
    b[t] = jnp.zeros((cfg.num_layers, rank, d_out), jnp.float32)
  return {"a": a, "b": b}


def train(model, examples, *, targets, rank: int, alpha: float, batch: int, steps: int,
          lr: float, seed: int, log_every: int = 10):
  """Returns (factors {"a": {t: [L, in, r]}, "b": ...} unscaled, [(step, loss)])."""
  import optax
  from jaxinfer.kv import allocate_pool
  from jaxinfer.model import transformer
  from jaxinfer.runtime.batcher import SeqWork, pack_exact
  cfg, params = model.cfg, model.params
  T = max(len(ids) for ids, _ in examples)
  T = -(-T // 16) * 16
  pages = T // 16
  works = [SeqWork([0] * T, 0, list(range(i * pages, (i + 1) * pages)), num_logits=0)
           for i in range(batch)]
  step_in = pack_exact(works, 16, batch * pages)
  meta = {k: jnp.asarray(v) for k, v in step_in.arrays.items() if k != "token_ids"}
  meta["lora_slot"] = jnp.zeros(batch * T, jnp.int32)  # one adapter: the gather mode
  attn_shape = step_in.bucket.attn_shape
  pool = allocate_pool(cfg, "f32", batch * pages, 16)
  scale = alpha / rank

  def loss_fn(factors, tok, tgt, mask):
    lora = {t: {"a": factors["a"][t][:, :, None], "b": factors["b"][t][:, None] * scale}
            for t in targets}
    x, _, _ = transformer.hidden_states(params, pool, dict(meta, token_ids=tok, lora=lora),
                                        cfg, attn_shape=attn_shape, backend="reference")
    logp = jax.nn.log_softmax(transformer.lm_head(params, x, cfg), axis=-1)
    nll = -jnp.take_along_axis(logp, tgt[:, None], axis=-1)[:, 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  opt = optax.adamw(lr, weight_decay=0.0)
  factors = init_factors(cfg, targets, rank, seed)
  state = opt.init(factors)

  @jax.jit
  def update(factors, state, tok, tgt, mask):
    loss, g = jax.value_and_grad(loss_fn)(factors, tok, tgt, mask)
    upd, state = opt.update(g, state, factors)
    return optax.apply_updates(factors, upd), state, loss

  rng = np.random.default_rng(seed)
  history = []
  for step in range(steps):
    tok = np.zeros((batch, T), np.int32)
    tgt = np.zeros((batch, T), np.int32)
    mask = np.zeros((batch, T), np.float32)
    for row, i in enumerate(rng.choice(len(examples), batch, replace=len(examples) < batch)):
      ids, m = examples[i]
      n = len(ids)
      tok[row, :n] = ids
      tgt[row, :n - 1] = ids[1:]  # position j predicts token j + 1
      mask[row, :n - 1] = m[1:]
    factors, state, loss = update(factors, state, jnp.asarray(tok.reshape(-1)),
                                  jnp.asarray(tgt.reshape(-1)), jnp.asarray(mask.reshape(-1)))
    if step % log_every == 0 or step == steps - 1:
      history.append((step, float(loss)))
  return factors, history


def main(argv):
  del argv
  from jaxinfer import LLM, SamplingParams
  from jaxinfer.lora import save_peft
  t0 = time.perf_counter()
  llm = LLM(FLAGS.model, warmup=False)
  examples = make_examples(llm, QUESTIONS, FLAGS.answer_tokens)
  print(f"{len(examples)} examples from the base model's answers in "
        f"{time.perf_counter() - t0:.1f}s")
  t1 = time.perf_counter()
  factors, history = train(llm.model, examples, targets=FLAGS.targets, rank=FLAGS.rank,
                           alpha=FLAGS.alpha, batch=FLAGS.batch, steps=FLAGS.steps,
                           lr=FLAGS.lr, seed=FLAGS.seed)
  for step, loss in history:
    print(f"step {step:4d}  answer NLL {loss:.4f}")
  print(f"trained {FLAGS.steps} steps in {time.perf_counter() - t1:.1f}s")
  save_peft(FLAGS.output, {t: np.asarray(v) for t, v in factors["a"].items()},
            {t: np.asarray(v) for t, v in factors["b"].items()}, llm.cfg, rank=FLAGS.rank,
            alpha=FLAGS.alpha, base_model=FLAGS.model)
  print(f"saved to {FLAGS.output}")
  tuned = LLM(llm.model, warmup=False, lora_adapters={"upper": FLAGS.output})
  sp = SamplingParams(max_tokens=30)
  base = tuned.generate(HELD_OUT, sp, chat=True)
  ours = tuned.generate(HELD_OUT, SamplingParams(max_tokens=30, lora="upper"), chat=True)
  for q, b, o in zip(HELD_OUT, base, ours):
    print(f"\n{q}\n  base  ({upper_share(b.text):.0%} upper): {b.text!r}\n"
          f"  upper ({upper_share(o.text):.0%} upper): {o.text!r}")
  print(f"\nheld-out upper-case share: base {np.mean([upper_share(b.text) for b in base]):.0%}"
        f", adapter {np.mean([upper_share(o.text) for o in ours]):.0%}")


def _define_flags():
  """Flags are defined when run as a program only: the tests import this module next to
  tools/train_draft.py, and absl refuses a flag (`output`, `steps`, ...) defined twice."""
  flags.DEFINE_string("model", "smollm2-135m-instruct", "base model")
  flags.DEFINE_string("output", "out/lora-upper", "adapter directory (PEFT format)")
  flags.DEFINE_integer("rank", 8, "LoRA rank")
  flags.DEFINE_float("alpha", 16.0, "LoRA alpha (scaling = alpha / rank)")
  flags.DEFINE_list("targets", ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"],
                    "adapted weights")
  flags.DEFINE_integer("answer_tokens", 40, "tokens of each base answer used as data")
  flags.DEFINE_integer("batch", 8, "examples per step")
  flags.DEFINE_integer("steps", 60, "optimizer steps")
  flags.DEFINE_float("lr", 2e-3, "AdamW learning rate")
  flags.DEFINE_integer("seed", 0, "seed")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
