"""Sharded training: one step on 8 fake CPU devices equals one device.

Runs in a subprocess because ``--xla_force_host_platform_device_count`` must be
set before JAX initialises.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dart_jax import sharding as model_sharding
from train import sharding
from tests import helpers

ROOT = str(helpers.ROOT)
# Eight fake devices; LLVM optimisation off halves the four compiles (one step
# runs, so code speed does not matter; both sides use the same flags).
_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"

_SCRIPT = r"""
import json, os, sys, time
os.environ["XLA_FLAGS"] = __FLAGS__
import jax
import numpy as np
sys.path.insert(0, __ROOT__)
import dart_jax as dj
from train import configs, data as data_lib, loop, overrides, sharding

assert jax.device_count() == 8
# Adam normalises the first update to about +-lr wherever |grad| >> eps, which
# would turn float-level gradient differences into sign noise on tiny gradients;
# a large eps makes the first update proportional to the gradient instead.
config = overrides.load_config("tiny", ["batch_size=8", "data.max_len=64",
                                      "loss.num_anchors=8", "optim.warmup_steps=0",
                                      "optim.eps=1.0", "optim.learning_rate=0.5"])
target = dj.load_target(configs.TINY_TARGET)
prepared = data_lib.prepare_data(config.data, target.tokenizer)
from tests.helpers import numpy_head  # no per-op init compiles
head = numpy_head(target, 3, 256, seed=0)
settings = loop.StepSettings(head.config, config.loss.num_anchors, config.loss.level_decay,
                             "float32", "auto", "xla", config.optim, config.steps)
local = next(data_lib.BatchIterator(prepared.train, 8, seed=0))
out = {}
for shape in [(1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2)]:
  t0 = time.time()
  devices = jax.devices()[:int(np.prod(shape))]
  mesh = sharding.make_mesh(*shape, devices=devices)
  with jax.set_mesh(mesh):
    state = loop.place_state(loop.init_state(head, settings, 0), settings, mesh)
    before = jax.device_get(state["params"])
    target_params = loop.place_target(target, mesh)
    batch = sharding.global_batch(local, mesh)
    new, metrics = loop.train_step(state, target_params, batch, settings=settings,
                                   target_graphdef=target.graphdef)
    after = jax.device_get(new["params"])
  flat = {"/".join(str(k.key) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(after)[0]}
  moved = max(float(np.abs(a - b).max()) for a, b in
              zip(jax.tree.leaves(after), jax.tree.leaves(before)))
  np.savez(os.path.join(__OUT__, "x".join(map(str, shape)) + ".npz"), **flat)
  q = new["params"]["midlayer"]["self_attn"]["q_proj"]["kernel"]
  tq = target_params["layers"][1]["self_attn"]["q_proj"]["weight"]  # fast mode: [out, in]
  mu = new["opt_state"][1][0].mu["midlayer"]["self_attn"]["q_proj"]["kernel"]
  out["x".join(map(str, shape))] = {
      "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
      "moved": moved, "head_q_spec": tuple(q.sharding.spec),
      "target_q_spec": tuple(jax.tree.leaves(tq)[0].sharding.spec),
      "adam_mu_spec": tuple(mu.sharding.spec), "batch_spec": tuple(batch["tokens"].sharding.spec),
      "seconds": time.time() - t0,
      "head_q_shards": len({str(s.index) for s in q.addressable_shards}),
  }
print("RESULT " + json.dumps(out))
"""


def test_spec_rules_replicate_dimensions_the_mesh_does_not_divide():
  import jax
  mesh = jax.sharding.AbstractMesh((2, 4, 1), sharding.AXES)
  assert model_sharding.spec_for("midlayer/self_attn/q_proj/kernel", (128, 64), mesh) == \
      jax.sharding.PartitionSpec("fsdp", None)
  assert model_sharding.spec_for("lm_head/kernel", (64, 250), mesh) == \
      jax.sharding.PartitionSpec("fsdp", None)  # 250 % 1: tensor axis is size 1
  assert model_sharding.spec_for("embed_tokens/embedding", (322, 64), mesh) == \
      jax.sharding.PartitionSpec(None, "fsdp")
  assert model_sharding.spec_for("norm/scale", (64,), mesh) == jax.sharding.PartitionSpec()
  # The fast modes' [out, in] weights shard the same dimensions, transposed.
  assert model_sharding.spec_for("layers/0/mlp/up_proj/weight", (64, 128), mesh) == \
      jax.sharding.PartitionSpec(None, "fsdp")
  assert model_sharding.spec_for("layers/0/mlp/down_proj/weight", (128, 64), mesh) == \
      jax.sharding.PartitionSpec("fsdp", None)


def test_one_step_on_8_devices_matches_one_device(tmp_path):
  script = (_SCRIPT.replace("__ROOT__", repr(ROOT)).replace("__OUT__", repr(str(tmp_path)))
            .replace("__FLAGS__", repr(_FLAGS)))
  env = dict(os.environ, XLA_FLAGS=_FLAGS, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=env, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
  results = json.loads(line[len("RESULT "):])
  print({name: round(r["seconds"], 1) for name, r in results.items()})
  single = results.pop("1x1x1")
  reference = np.load(tmp_path / "1x1x1.npz")
  assert single["moved"] > 1e-3  # the step really changed the parameters
  for name, r in results.items():
    got = np.load(tmp_path / f"{name}.npz")
    print(name, "loss diff", abs(r["loss"] - single["loss"]), "max param diff",
          max(float(np.abs(got[k] - reference[k]).max()) for k in reference.files))
    assert r["loss"] == pytest.approx(single["loss"], rel=1e-5), name
    assert r["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4), name
    got = np.load(tmp_path / f"{name}.npz")
    assert set(got.files) == set(reference.files)
    for key in reference.files:
      np.testing.assert_allclose(got[key], reference[key], rtol=0, atol=1e-6,
                                 err_msg=f"{name}: {key}")
  # The batch is split over (data, fsdp) and the matrices over (fsdp, tensor).
  assert results["8x1x1"]["batch_spec"] == [["data", "fsdp"]]
  assert results["2x2x2"]["head_q_spec"] == ["fsdp", "tensor"]
  assert results["2x2x2"]["target_q_spec"] == ["tensor", "fsdp"]  # [out, in] weight
  assert results["2x2x2"]["adam_mu_spec"] == ["fsdp", "tensor"]
  # tensor has size 1 there: only fsdp (JAX drops trailing Nones).
  assert results["2x4x1"]["head_q_spec"] in (["fsdp"], ["fsdp", None])
  assert results["2x2x2"]["head_q_shards"] == 4


def test_distributed_initialize_only_where_it_belongs(monkeypatch):
  import jax

  calls = []

  def fake_initialize():
    calls.append(1)
    raise ValueError("coordinator_address should be defined.")

  monkeypatch.setattr(jax.distributed, "initialize", fake_initialize)
  for name in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS",
               "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  assert model_sharding.maybe_initialize_distributed("off") is False and not calls
  assert model_sharding.maybe_initialize_distributed("auto") is False and len(calls) == 1
  def too_late():
    raise RuntimeError("jax.distributed.initialize() must be called before any JAX "
                       "computations are executed.")

  monkeypatch.setattr(jax.distributed, "initialize", too_late)
  assert model_sharding.maybe_initialize_distributed("auto") is False  # e.g. in a notebook
  with pytest.raises(RuntimeError):
    model_sharding.maybe_initialize_distributed("on")
  monkeypatch.setattr(jax.distributed, "initialize", fake_initialize)
  monkeypatch.setenv("SLURM_NTASKS", "4")  # several hosts: the error must surface
  with pytest.raises(ValueError):
    model_sharding.maybe_initialize_distributed("auto")
