"""experiments.fleet: replicas of the real scheduler on the cost model's clock behind the
routing policies, under an agent-session stream and a bursty stream.

  python -m experiments.fleet --config=configs/studies/fleet.py[:small|:scale]

scale: 256 replicas, 1,000,000 bursty requests at the default's rate per replica, routed
by power of two choices (O(1) replicas read per request) in 2 cells of 128 replicas, one
process each.
"""
import ml_collections


def get_config(mode: str = ""):
  c = ml_collections.ConfigDict()
  c.model = "qwen3-8b"
  c.hardware = "rtx-pro-6000"
  c.kv_budget_gib = 12.0  # each replica's KV pool (8.1's budget)
  c.max_running = 64
  c.token_budget = 8192
  c.replicas = 8
  c.policies = ("round_robin", "least_loaded", "power_of_two", "prefix", "slo")
  c.streams = ("sessions", "bursty")
  c.autoscaling = True  # also the diurnal stream, fixed and autoscaled
  c.workers = 0  # processes running the conditions (0: one per CPU; 1: in this process)
  # cells of a routed condition: each a router over replicas / cells replicas, requests
  # dealt to them in turn, each cell in its own process (1: one router over every replica)
  c.cells = 1
  c.balance_threshold = 2  # prefix: loads (requests) further apart than this go least-loaded
  c.seed = 0
  # agent sessions sharing a system prompt and their own history (8.3.3-like)
  c.sessions = ml_collections.ConfigDict(dict(
      num_sessions=64, turns=8, rate=2.0, system_tokens=2048, user_tokens=256,
      output_tokens=128, think_s=4.0))
  # independent requests in bursts: gamma gaps, coefficient of variation cv
  c.bursty = ml_collections.ConfigDict(dict(
      num_requests=2000, rate=40.0, cv=4.0, prompt_median=1024, prompt_sigma=1.0,
      prompt_max=8192, output_median=128, output_sigma=0.8, output_max=1024))
  # a diurnal stream, served by a fixed fleet of max_replicas and by an autoscaled one
  c.autoscale = ml_collections.ConfigDict(dict(
      num_requests=6000, rate=10.0, amplitude=0.8, period_s=300.0, prompt_median=1024,
      output_median=128, min_replicas=1, max_replicas=8, target_load=16.0,
      down_fraction=0.5, warmup_s=20.0, policy="least_loaded"))
  # disaggregated prefill / decode pools against colocated replicas at equal GPUs: one
  # stream long in prompts, one long in outputs; every split n_p : gpus - n_p; K/V over a
  # link of link_gbs per direction (400 Gb/s RDMA) after prefill
  c.disaggregation = True
  c.disagg = ml_collections.ConfigDict(dict(
      gpus=8, num_requests=1500, link_gbs=50.0, link_latency_us=20.0, slo_ttft_s=1.0,
      slo_tpot_ms=40.0, streams=dict(
          prompt_heavy=dict(rate=12.0, prompt_median=4096, output_median=64),
          decode_heavy=dict(rate=30.0, prompt_median=512, output_median=512))))
  c.slo_ttft_s = 2.0  # a good answer: finished, its first token within this
  c.gpu_hour_price = 2.0  # per replica-hour, for the cost per good answer
  if mode == "small":
    c.replicas = 4
    c.sessions.num_sessions = 16
    c.sessions.turns = 5
    c.bursty.num_requests = 300
    c.bursty.rate = 20.0
    c.autoscale.num_requests = 1200
    c.autoscale.rate = 5.0
    c.autoscale.period_s = 120.0
    c.autoscale.max_replicas = 4
    c.disagg.gpus = 4
    c.disagg.num_requests = 200
    c.disagg.streams.prompt_heavy.rate = 6.0
    c.disagg.streams.decode_heavy.rate = 13.0
  elif mode == "scale":  # the bursty stream's rate per replica, over 256 replicas
    c.replicas = 256
    c.policies = ("power_of_two",)
    c.cells = 2  # one per core of the 2-core machine
    c.streams = ("bursty",)
    c.autoscaling = False
    c.disaggregation = False
    c.bursty.num_requests = 1_000_000
    c.bursty.rate = 40.0 * 256 / 8
  elif mode:
    raise ValueError(f"unknown mode {mode!r}: '', 'small' or 'scale'")
  return c
