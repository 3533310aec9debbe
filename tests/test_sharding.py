"""Several devices (jaxinfer/sharding.py, runtime/router.py): tensor parallel greedy
tokens equal one device's (tp 1/2/4 on a random Qwen3 with 8 KV heads, tp 3 on SmolLM2
through the CLI, tp 2 across two jax.distributed processes), each device holds 1/tp of
the split weights and KV, a warm sharded engine never recompiles, dp replicas behind the
router serve every request once with one device's outputs; the mesh and routing checks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from jaxinfer import sharding
from jaxinfer.config import MODEL_CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "sharding_worker.py")


def _env(devices: int) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip(),
             JAX_PLATFORMS="cpu")
  return env


def _last_json(text: str) -> dict:
  return json.loads(text.strip().splitlines()[-1])


def _free_port() -> int:
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()
  return port


class _Job:
  """A subprocess whose output goes to files (no pipe to fill up while another job is
  awaited)."""

  def __init__(self, args, env, tmp):
    self.out = open(tmp / f"job{id(self)}.out", "w+")
    self.err = open(tmp / f"job{id(self)}.err", "w+")
    self.proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=self.out, stderr=self.err,
                                 text=True)

  def result(self, timeout=600):
    """(stdout, the last JSON line of it); fails the test with stderr's tail on an error."""
    rc = self.proc.wait(timeout=timeout)
    self.out.seek(0)
    self.err.seek(0)
    out, err = self.out.read(), self.err.read()
    assert rc == 0, err[-3000:]
    return out, _last_json(out)

  def close(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    self.out.close()
    self.err.close()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """Every multi-device subprocess of this module, started at once: each mostly compiles
  on one core, so on two cores they take about half the time one after another would."""
  tmp = tmp_path_factory.mktemp("sharding")
  port = _free_port()
  started = {
      "tp": _Job([sys.executable, WORKER, "tp"], _env(8), tmp),
      "ep": _Job([sys.executable, WORKER, "ep"], _env(4), tmp),
      "dist0": _Job([sys.executable, WORKER, "dist", str(port), "0"], _env(1), tmp),
      "dist1": _Job([sys.executable, WORKER, "dist", str(port), "1"], _env(1), tmp),
      "cli_tp3": _Job([sys.executable, "-m", "jaxinfer", "generate", "--mesh=tp:3", "--json",
                       "--nowarmup", "--max_tokens=6", f"--prompt={CLI_PROMPT}"], _env(3), tmp),
  }
  yield started
  for j in started.values():
    j.close()


CLI_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tp_run(jobs):
  return jobs["tp"].result()[1]


def test_tensor_parallel_tokens_equal_one_device(tp_run):
  ref = tp_run["tokens"]["tp:1"]
  assert len(ref) == 3 and all(len(t) == 6 for t in ref)
  # both CPU attention backends; speculative decoding's draft and verify steps sharded
  for mesh in ("tp:2", "tp:4", "dp:2", "tp:2 reference", "tp:2 early_exit"):
    assert tp_run["tokens"][mesh] == ref, mesh
  assert tp_run["spec_rounds"] > 0


def test_each_device_holds_its_share(tp_run):
  for tp in ("1", "2", "4"):
    for what in ("weights", "pool"):
      rec = tp_run[what][tp]
      assert len(rec["per_device"]) == int(tp), (what, tp)
      for dev, n in rec["per_device"].items():
        assert n * int(tp) == rec["full"], (what, tp, dev, n)


def test_warm_sharded_engine_never_recompiles(tp_run):
  assert tp_run["compiled_when_warm"] == 0


def test_data_parallel_serves_each_request_once_on_its_own_devices(tp_run):
  for mesh, groups in (("dp:2", [[0], [1]]),):
    served = tp_run["served"][mesh]
    ids = [i for rep in served for i in rep]
    assert sorted(ids) == list(range(3)), (mesh, served)
    assert all(served), f"{mesh}: a replica served nothing: {served}"
    assert tp_run["replica_devices"][mesh] == groups


def test_two_processes_jax_distributed_tp2(jobs, tp_run):
  outs = [jobs[f"dist{i}"].result(timeout=300)[1] for i in range(2)]
  for i, o in enumerate(outs):
    assert o["process"] == i and o["processes"] == 2 and len(o["devices"]) == 2
    assert len(o["pool_local_bytes"]) == 1  # each process holds its own half of the KV
    assert o["tokens"] == tp_run["tokens"]["tp:1"]


def test_cli_generate_tp3_on_smollm2_matches_recompute(jobs, smollm2):
  from helpers import recompute_greedy
  out = jobs["cli_tp3"].result()[1]
  ids = smollm2.tokenizer.encode(CLI_PROMPT)
  assert out["prompt_token_ids"] == ids
  assert out["token_ids"] == recompute_greedy(smollm2.cfg, smollm2.params, ids, 6)


def test_expert_parallel_tokens_equal_one_device_and_split_the_experts(jobs):
  """ep:2 and tp:2 x ep:2 on a random MoE, ep:2 on a latent-attention MoE with a
  dense first layer: one device's greedy tokens; each device holds 1/(ep x tp) of the
  expert weights (the FFN width split over tp inside each expert)."""
  out = jobs["ep"].result()[1]
  for name, meshes in (("moe", ("ep:2", "tp:2,ep:2")), ("mla", ("ep:2",))):
    ref = out["tokens"][f"{name} tp:1"]
    assert len(ref) == 3 and all(len(t) == 6 for t in ref)
    for mesh in meshes:
      assert out["tokens"][f"{name} {mesh}"] == ref, (name, mesh)
      rec = out["experts"][f"{name} {mesh}"]
      n = 4 if mesh == "tp:2,ep:2" else 2
      assert len(rec["per_device"]) == n and rec["full"] > 0, (name, mesh, rec)
      assert all(b * n == rec["full"] for b in rec["per_device"].values()), (name, mesh, rec)


def test_mesh_spec_and_tp_checks():
  assert sharding.MeshSpec.parse("tp:2,dp:3") == sharding.MeshSpec(2, 3)
  assert sharding.MeshSpec.parse("dp:2") == sharding.MeshSpec(1, 2)
  assert sharding.MeshSpec.parse("tp:2,ep:4,dp:2") == sharding.MeshSpec(2, 2, 4)
  assert sharding.MeshSpec.parse("ep:4").devices == 4
  for bad in ("tp2", "tp:0", "tp:2,tp:2", "pp:2", "ep:0", 3):
    with pytest.raises(ValueError, match="mesh"):
      sharding.MeshSpec.parse(bad)
  smol = MODEL_CONFIGS["smollm2-135m-instruct"]
  smol.check_tp(3)
  with pytest.raises(ValueError, match=r"tp=2 does not divide .*num_heads=9.*possible: \[1, 3\]"):
    smol.check_tp(2)
  with pytest.raises(ValueError, match="needs 4 devices, 1 are visible"):
    sharding.device_groups(sharding.MeshSpec(2, 2))
  with pytest.raises(ValueError, match="ep=2 needs a mixture of experts"):
    smol.check_ep(2)
  with pytest.raises(ValueError, match="ep=3 needs .* num_experts=128"):
    MODEL_CONFIGS["qwen3-30b-a3b"].check_ep(3)


def test_cli_refuses_a_mesh_larger_than_the_machine():
  p = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", "--mesh=tp:3,dp:2"],
                     env=_env(4), capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert p.returncode == 2
  assert "needs 6 devices, 4 are visible" in p.stderr


def test_prefix_routing_keeps_sessions_on_their_replica():
  """Simulated replicas (Qwen3-8B on RTX PRO 6000), agent sessions advancing together:
  routing by prefix serves more of the sessions' prompt tokens from cache than round
  robin, which sends a session's rounds to other replicas."""
  from experiments.prefix_reuse import SessionShape, run_dp_sessions, sim_engine
  from jaxinfer.runtime.router import Router
  shape = SessionShape().scaled(0.25)
  res = {}
  for routing in ("prefix", "round_robin"):
    router = Router([sim_engine(2.0, 0) for _ in range(2)], routing)
    res[routing] = run_dp_sessions(router, shape, sessions=3, rounds=4)
    assert sum(res[routing]["routed"]) == 4 * (3 + shape.interfering)
  assert res["prefix"]["hit_fraction"] > res["round_robin"]["hit_fraction"] + 0.05, res
  with pytest.raises(ValueError, match="routing must be one of"):
    Router([sim_engine(1.0, 0)], "random")


def test_router_ids_aborts_and_balance():
  """Global request ids across replicas (a duplicate is refused before anything changes),
  aborts reach the owning replica, and a replica loaded past the threshold stops getting
  prefix matches."""
  from experiments.prefix_reuse import sim_engine
  from jaxinfer.config import SamplingParams
  from jaxinfer.runtime.router import Router
  router = Router([sim_engine(1.0, 0) for _ in range(2)], "prefix", balance_threshold=1)
  sp = SamplingParams(max_tokens=4, ignore_eos=True)
  shared = list(range(100, 164))  # four pages of 16 tokens
  a = router.add_request(shared + [1], sp)
  b = router.add_request(shared + [2], sp)  # same prefix: same replica as a
  assert router.replica_of(a.request_id) == router.replica_of(b.request_id)
  c = router.add_request(shared + [3], sp)  # loads 2 vs 0 > threshold 1: the other one
  assert router.replica_of(c.request_id) != router.replica_of(a.request_id)
  with pytest.raises(ValueError, match="already in use"):
    router.add_request([5, 6], sp, request_id=a.request_id)
  assert sum(router.routed) == 3
  assert router.abort(b.request_id) and b.finish_reason == "abort"
  assert not router.abort("no-such-id")
  router.run()
  assert a.finish_reason == "length" and c.finish_reason == "length"
  assert not router.has_unfinished() and router.num_steps == len(router.steps) > 0
