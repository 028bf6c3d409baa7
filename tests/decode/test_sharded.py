"""Sharded inference on 8 fake CPU devices equals one device, token for token.

The checks run in one subprocess because ``--xla_force_host_platform_device_count``
must be set before JAX initialises; the tests below read its JSON report.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

import dart_jax as dj
from dart_jax import sharding
from tests import helpers

# LLVM optimisation off shortens the many small compiles; both sides of every
# comparison run under the same flags.
_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"

_SCRIPT = r"""
import json, logging, os, sys, time
os.environ["XLA_FLAGS"] = __FLAGS__
import jax
import numpy as np
sys.path.insert(0, __ROOT__)
import dart_jax as dj
from dart_jax import profiling, sharding
from dart_jax.sampling import SamplingConfig
from tests import helpers

assert jax.device_count() == 8
records = []
class Keep(logging.Handler):
  def emit(self, record):
    records.append(record.getMessage())
logging.getLogger("dart_jax").addHandler(Keep())
logging.getLogger("dart_jax").setLevel(logging.INFO)

NEW = 6
report = {}

def methods(target, trained):
  if trained:
    return {"ar": None, "dart": dj.DART(dj.load_dart(None, target), dj.load_ngram())}
  head = dj.DartHead.init(target, draft_length=3, seed=4)
  domino = dj.DFlashDrafter.init(target, block_size=4, num_layers=1, domino=True, seed=4)
  return {"ar": None, "dart": dj.DART(head, None), "dartree": dj.DARTree(domino)}

def outputs(target, prompts, trained, sampled):
  out = {}
  for name, method in methods(target, trained).items():
    for temperature in (0.0, 1.0) if sampled else (0.0,):
      extra = {} if method is None else {"method": method}
      # Eight devices map eight copies of every program: stay under vm.max_map_count.
      profiling.free_compiled_code_near_map_limit(0.5)
      out[f"{name}@{temperature}"] = dj.generate(
          target, prompts, max_new_tokens=NEW, temperature=temperature, seed=3,
          chat=False, **extra).tokens
  return out

def bytes_on(array, device):
  return sum(s.data.nbytes for s in array.addressable_shards if s.device == device)

def memory(target):
  device = target.mesh.devices.flat[0]
  leaves = jax.tree.leaves(target.params)
  total = sum(x.nbytes for x in leaves)
  replicated = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
  cache = target.new_cache(8, 64)
  return {"total": total, "replicated": replicated,
          "on_device": sum(bytes_on(x, device) for x in leaves),
          "cache_total": cache.k[0].nbytes, "cache_on_device": bytes_on(cache.k[0], device)}

def round_without_transfers(target, prompts):
  # One DART round under a transfer guard, and a second generate that compiles nothing.
  head = dj.DartHead.init(target, draft_length=3, seed=4)
  method = dj.DART(head, None)
  dj.generate(target, prompts, max_new_tokens=NEW, chat=False, method=method)
  with profiling.CompileWatch() as watch:
    dj.generate(target, prompts, max_new_tokens=NEW, chat=False, method=method)
  decoder = method.decoder(target, SamplingConfig(), seed=0)
  ids = np.zeros((8, 16), np.int32)
  lens = np.array([len(p) for p in prompts], np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  state, _ = decoder.start(target.place_batch(ids), target.place_batch(lens), 64)
  active = target.place_batch(np.ones(8, bool))
  state, _, _ = decoder.step(state, active, 32)  # compiles (the state is donated)
  guard = "ok"
  try:
    with jax.transfer_guard("disallow"):
      jax.block_until_ready(decoder.step(state, active, 32))
  except Exception as e:
    guard = f"{type(e).__name__}: {e}"[:300]
  return {"recompiles": [name for name, _ in watch.decode_compiles], "guard": guard}

rng = np.random.default_rng(0)
for name, trained, meshes in __FIXTURES__:
  path = None if name == "smollm2" else str(helpers.FIXTURES / name)
  prompts = helpers.random_prompts(rng, 8, 320 if path else 49152)
  ref = outputs(dj.load_target(path), prompts, trained,
                sampled=any(sampled for _, _, sampled in meshes))
  for data, tensor, sampled in meshes:
    records.clear()
    start = time.time()
    mesh = sharding.parse_mesh(f"data={data},tensor={tensor}")
    target = dj.load_target(path, mesh=mesh)
    got = outputs(target, prompts, trained, sampled)
    entry = {"same": {k: got[k] == ref[k] for k in got}, "memory": memory(target),
             "log": list(records), "seconds": round(time.time() - start, 1)}
    if (data, tensor) == (4, 2) and name == "tiny_llama":
      entry.update(round_without_transfers(target, prompts))
    report[f"{name}:{data}x{tensor}"] = entry
  if name == "tiny_llama":
    # Loading reads each device's slices of a split matrix, never the whole one.
    from dart_jax.io import safetensors_io
    reads, read = [], safetensors_io.LazyTensor.__getitem__
    def spy(self, index):
      piece = read(self, index)
      reads.append((self.name, piece.size / int(np.prod(self.shape))))
      return piece
    safetensors_io.LazyTensor.__getitem__ = spy
    loaded = dj.load_target(path, mesh=sharding.parse_mesh("data=4,tensor=2"))
    safetensors_io.LazyTensor.__getitem__ = read
    placed = dj.load_target(path).shard(loaded.mesh)
    pairs = list(zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params)))
    report["streaming"] = {
        "up_proj": max(f for n, f in reads if "up_proj" in n),
        "norm": max(f for n, f in reads if "layernorm" in n),
        "same_as_shard": all(np.array_equal(a, b) and a.sharding == b.sharding
                             for a, b in pairs)}
    # A MoE target: each expert's matrices split over 'tensor'.
    moe_path = str(helpers.FIXTURES / "tiny_qwen3_moe")
    moe_ref = dj.generate(dj.load_target(moe_path), prompts, max_new_tokens=NEW, chat=False)
    moe = dj.load_target(moe_path, mesh=sharding.parse_mesh("data=4,tensor=2"))
    experts = moe.params["layers"][0]["mlp"]["experts"]["up_proj"]
    report["moe:4x2"] = {
        "same": dj.generate(moe, prompts, max_new_tokens=NEW, chat=False).tokens
                == moe_ref.tokens,
        "expert_spec": str(jax.tree.leaves(experts)[0].sharding.spec)}
    # The Pallas GPU kernel (interpreted) per shard under shard_map.
    kernel = dj.load_target(path, mesh=sharding.parse_mesh("data=4,tensor=2"),
                            attn_impl="pallas_gpu:interpret")
    head = dj.DartHead.init(kernel, draft_length=3, seed=4)
    kw = dict(max_new_tokens=NEW, chat=False, seed=3)
    report["pallas_gpu:4x2"] = {"same": {
        "ar@0.0": dj.generate(kernel, prompts, **kw).tokens == ref["ar@0.0"],
        "dart@0.0": dj.generate(kernel, prompts, method=dj.DART(head, None), **kw).tokens
                    == ref["dart@0.0"]}}
print("RESULT " + json.dumps(report))
"""

# (fixture, trained drafters, meshes as (data, tensor, also sampled)). Every mesh
# compiles every program anew, so the matrix stays small: tiny Llama on each mesh
# shape (heads that do not split 8 ways, both axes sampled too, rows only); Qwen3
# (q/k norms) and the embedded SmolLM2 with its trained head on one mesh each.
FIXTURES = (
    ("tiny_llama", False, ((1, 8, False), (4, 2, True), (8, 1, False))),
    ("tiny_qwen3", False, ((4, 2, False),)),
    ("smollm2", True, ((1, 3, False),)),
)
SAMPLED = {f"{name}:{d}x{t}" for name, _, meshes in FIXTURES for d, t, s in meshes if s}


@pytest.fixture(scope="module")
def report():
  script = (_SCRIPT.replace("__ROOT__", repr(str(helpers.ROOT)))
            .replace("__FLAGS__", repr(_FLAGS)).replace("__FIXTURES__", repr(FIXTURES)))
  env = dict(os.environ, XLA_FLAGS=_FLAGS, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=env, cwd=str(helpers.ROOT), timeout=1500)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  report = json.loads(line[len("RESULT "):])
  print("seconds per mesh:", {k: v["seconds"] for k, v in report.items() if "seconds" in v})
  return report


RUNS = [f"{name}:{d}x{t}" for name, _, meshes in FIXTURES for d, t, _ in meshes]


def test_loading_reads_slices_and_equals_sharding_a_loaded_target(report):
  streaming = report["streaming"]
  assert streaming["up_proj"] == 0.5 and streaming["norm"] == 1.0
  assert streaming["same_as_shard"]


def test_moe_target_splits_each_expert_and_decodes_the_same(report):
  moe = report["moe:4x2"]
  assert moe["same"] and "tensor" in moe["expert_spec"], moe


def test_pallas_kernel_runs_per_shard(report):
  # The GPU kernel in interpret mode; the TPU interpreter's host callbacks hang
  # across fake CPU devices, so its shard_map runs on TPUs only.
  assert report["pallas_gpu:4x2"]["same"] == {"ar@0.0": True, "dart@0.0": True}


@pytest.mark.parametrize("run", RUNS)
def test_sharded_outputs_equal_one_device(report, run):
  same = report[run]["same"]
  methods = {k.split("@")[0] for k in same}
  assert methods == ({"ar", "dart"} if run.startswith("smollm2") else {"ar", "dart", "dartree"})
  sampled = {k for k in same if k.endswith("@1.0")}
  assert sampled == ({m + "@1.0" for m in methods} if run in SAMPLED else set())
  assert all(same.values()), same


@pytest.mark.parametrize("run", ["tiny_llama:4x2", "tiny_qwen3:4x2", "smollm2:1x3"])
def test_parameters_and_kv_cache_split_over_tensor(report, run):
  memory = report[run]["memory"]
  tensor, data = int(run[-1]), int(run.split(":")[1].split("x")[0])
  # Everything but the norms is split: a device holds 1/tensor of the rest.
  assert memory["replicated"] < 0.05 * memory["total"]
  sharded = memory["total"] - memory["replicated"]
  assert memory["on_device"] == sharded // tensor + memory["replicated"]
  assert memory["cache_on_device"] * data * tensor == memory["cache_total"]


def test_heads_that_do_not_split_replicate_attention_and_say_so(report):
  log = report["tiny_llama:1x8"]["log"]
  assert any("4 query / 2 key-value heads do not split 8 ways" in m for m in log), log
  memory = report["tiny_llama:1x8"]["memory"]
  assert memory["on_device"] > (memory["total"] - memory["replicated"]) // 8
  # KV heads (2) do not split 8 ways: the cache is replicated over 'tensor'.
  assert memory["cache_on_device"] == memory["cache_total"]


def test_a_round_compiles_once_and_moves_nothing_to_the_host(report):
  assert report["tiny_llama:4x2"]["recompiles"] == []
  assert report["tiny_llama:4x2"]["guard"] == "ok"


def test_bad_meshes_get_clear_errors():
  with pytest.raises(dj.ConfigError, match="data=N,tensor=M"):
    sharding.parse_mesh("rows=2")
  with pytest.raises(dj.ConfigError, match="not an integer"):
    sharding.parse_mesh("tensor=two")
  with pytest.raises(dj.ConfigError, match="devices"):
    sharding.parse_mesh(f"tensor={jax.device_count() + 1}")
  wrong_axes = jax.make_mesh((1,), ("model",))
  with pytest.raises(dj.ConfigError, match="axis named 'tensor'"):
    dj.load_target(str(helpers.FIXTURES / "tiny_llama"), mesh=wrong_axes)
  with pytest.raises(dj.ConfigError, match="jax.sharding.Mesh"):
    dj.load_target(str(helpers.FIXTURES / "tiny_llama"), mesh="data=1,tensor=1")
