"""experiments.kv_quality (chapter 8.4.4): KV storage format vs quality on SmolLM2.

  python -m experiments.kv_quality --config=configs/studies/kv_quality.py[:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"
  # Variants "format[:q]": q = "kv" rounds Q through the KV format's compute path
  # (8.4.4 (b)); without it Q stays in the f32 compute dtype ((c)). f32 is the reference.
  c.variants = ("f32", "bf16", "fp8", "fp8:kv", "q8_0", "q8_0:kv", "q4_0", "q4_0:kv")
  # Retrieval tasks: documents of `size` records "word: six-digit number", one question
  # each (the chapter's 128 / 512 records scaled to what a 135M model solves).
  c.sizes = (8, 32)
  c.docs_per_size = 4
  c.runs = 2  # each task run twice ...
  c.concurrency = (1, 4)  # ... at each concurrency
  # Free generation, low temperature (greedy solves ~70% of these tasks here); seeds are
  # fixed per (task, run), the same for every variant.
  c.temperature = 0.3
  c.top_p = 0.95
  c.max_tokens = 10
  c.seed = 0
  # Teacher-forced agreement with the f32 model over experiments/data/texts.txt, token
  # by token (each position attends to the KV stored in the variant's format).
  c.tf_texts = 4
  c.tf_tokens = 160
  c.timing_steps = 24  # decode steps timed per variant after teacher forcing
  if mode == "small":
    c.variants = ("f32", "q4_0", "q4_0:kv")
    c.sizes = (8,)
    c.docs_per_size = 2
    c.runs = 1
    c.concurrency = (1, 2)
    c.tf_texts = 2
    c.tf_tokens = 24
    c.timing_steps = 4
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '' or 'small'")
  return c
