"""experiments.goodput (SPEC 8.6.2): completion throughput vs goodput under load.

  python -m experiments.goodput --config=configs/studies/goodput.py[:small]

The chapter's experiment (8 retrieval questions, 3 s deadline, 1 / 4 / 16 req/s, three
windows of 16) scaled to SmolLM2 on a 2-core CPU: the low rate is served comfortably,
the high rate overloads every mode, and the deadline is a few times one request's
unloaded latency.
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"
  c.questions = 8  # retrieval questions with known answers (cycled through the window)
  c.records = 16  # records per question's document
  c.max_tokens = 10  # the answer is six digits; generation stops at the newline
  c.prompt_pages = 16  # pages of 16 tokens per request (prompt + answer)
  c.processes = ("poisson", "fixed")
  c.rates = (1.0, 4.0, 16.0)  # req/s
  c.modes = ("sequential", "continuous", "all_at_once", "deadline")
  c.window = 16  # requests per window
  c.windows = 3  # windows per condition
  c.deadline_s = 2.0
  c.token_budget = 256  # tokens per iteration (continuous / deadline / sequential)
  c.seed = 0
  if mode == "small":
    c.questions = 2
    c.records = 8
    c.processes = ("fixed",)
    c.rates = (2.0, 32.0)
    c.modes = ("sequential", "continuous", "deadline")
    c.window = 4
    c.windows = 1
    c.deadline_s = 1.0
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '' or 'small'")
  return c
