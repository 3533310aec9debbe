"""experiments.config_select (chapter 8.6.3): planner choice and simulated runs.

  python -m experiments.config_select --config=configs/studies/config_select.py[:small]
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.variants_file = ""  # default: configs/plan_select.json
  c.simulate = ("A", "B", "C", "D", "E")  # variants run through the scheduler
  c.num_requests = 16
  c.deadline_s = 7.0
  # The chapter's scenario and its two re-selections.
  c.scenarios = (
      ml_collections.ConfigDict({"name": "12GiB-256", "kv_budget_gib": 12.0,
                                 "output_tokens": 256}),
      ml_collections.ConfigDict({"name": "6GiB-256", "kv_budget_gib": 6.0,
                                 "output_tokens": 256}),
      ml_collections.ConfigDict({"name": "12GiB-16", "kv_budget_gib": 12.0,
                                 "output_tokens": 16}),
  )
  c.draft_len = 4  # drafts per round for D and E (acceptance set from tokens per round)
  c.token_budget = 8192  # tokens per iteration (chunked prefill)
  c.page_size = 16
  c.seed = 0
  if mode == "small":
    c.simulate = ("B", "D", "E")
    c.scenarios = c.scenarios[:1]
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '' or 'small'")
  return c
