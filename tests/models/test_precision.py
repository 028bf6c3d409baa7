"""The matmul policy: exact bf16 splits, dot forms, modes, and where they apply."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dart_jax as dj
from dart_jax.models import ModelConfig, Target, checkpoint, precision
from dart_jax.models import target as target_lib
from dart_jax.models.precision import FAST, FAST_ROWS, FLOAT32, matmul, split3
from dart_jax.models.transformer import causal_mask

CONFIG = ModelConfig(arch="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=128)


@pytest.fixture
def xla_dots(monkeypatch):
  """The XLA bf16 dot forms themselves, where the CPU kernel or widened weights
  would otherwise run."""
  monkeypatch.setattr(precision, "cpu_kernel_active", lambda: False)
  monkeypatch.setattr(precision, "_widens_weights", lambda w, p: False)


def _activations(m, k, seed=0):
  # Spread over many binades so the split's parts all matter.
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 8, (m, k)))
          ).astype(np.float32)


def test_split3_reconstructs_float32_to_its_last_bits():
  x = _activations(64, 96)
  parts = np.asarray(split3(jnp.asarray(x)).astype(jnp.float32), np.float64)
  hi, mid, lo = parts[:64], parts[64:128], parts[128:]
  err = np.abs(hi + mid + lo - x.astype(np.float64))
  assert np.all(err <= 2.0 ** -24 * np.abs(x)), err.max()
  # A two-part split is not enough: the third part carries real bits.
  assert np.max(np.abs(hi + mid - x) / np.abs(x)) > 2.0 ** -20


@pytest.mark.parametrize("transposed", [False, True])
def test_split3_dot_is_as_exact_as_float32_and_rows_is_not(transposed, xla_dots):
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((96, 200)) * 0.05, jnp.bfloat16)
  x = jnp.asarray(_activations(9, 96))
  exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
  w_arg = w.T if transposed else w
  scale = np.abs(exact).max()

  def err(prec):
    got = matmul(x, w_arg, prec, transposed=transposed)
    assert got.dtype == jnp.float32
    return np.abs(np.asarray(got, np.float64) - exact).max() / scale

  f32 = matmul(x, w_arg.astype(jnp.float32), FLOAT32, transposed=transposed)
  f32_err = np.abs(np.asarray(f32, np.float64) - exact).max() / scale
  assert err(FAST) <= max(4 * f32_err, 1e-6)
  assert err(FAST_ROWS) > 100 * err(FAST)  # rounded rows lose bits (drafters only)


def test_split3_rows_do_not_depend_on_how_many_rows_a_call_holds(xla_dots):
  """What keeps verification lossless: a row's result is the same whether the
  call holds 1 row (decode) or 27 (a tree)."""
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((96, 300)) * 0.05, jnp.bfloat16)
  x = jnp.asarray(_activations(27, 96, seed=3))
  batched = np.asarray(jax.jit(lambda a: matmul(a, w, FAST))(x))
  one = np.stack([np.asarray(jax.jit(lambda a: matmul(a, w, FAST))(x[i:i + 1]))[0]
                  for i in range(27)])
  np.testing.assert_allclose(one, batched, rtol=0, atol=2e-6 * np.abs(batched).max())


def test_one_row_bf16_dot_is_padded_and_equals_the_row_of_a_larger_call(xla_dots):
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.standard_normal((64, 50)), jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  single = matmul(x[:1], w, FAST_ROWS)
  assert single.shape == (1, 50)
  np.testing.assert_allclose(np.asarray(single), np.asarray(matmul(x, w, FAST_ROWS))[:1],
                             rtol=1e-6, atol=1e-6)


def test_resolve_modes_names_dtypes_and_errors():
  assert precision.resolve(None) is precision.default()
  assert precision.resolve("float32") is FLOAT32
  assert precision.resolve(jnp.float32) is FLOAT32
  assert precision.resolve(np.float32) is FLOAT32
  assert precision.resolve(jnp.bfloat16) is precision.BFLOAT16
  assert precision.resolve("fast-rows") is FAST_ROWS
  assert FAST.for_drafter() is FAST_ROWS and FLOAT32.for_drafter() is FLOAT32
  with pytest.raises(dj.ConfigError, match="unknown precision"):
    precision.resolve("fp8")
  with pytest.raises(dj.ConfigError, match="floating"):
    precision.resolve(np.int32)


def test_cli_flag_names_every_mode_and_auto_is_the_default():
  parser = argparse.ArgumentParser()
  precision.add_cli_flag(parser)
  assert precision.resolve_flag(parser.parse_args([]).precision) is precision.default()
  args = parser.parse_args(["--precision", "float32"])
  assert precision.resolve_flag(args.precision) is FLOAT32
  with pytest.raises(SystemExit):
    parser.parse_args(["--precision", "fp8"])


def _dtypes(params):
  return {"/".join(str(k) for k in path): leaf.dtype
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def test_fast_target_stores_bf16_weights_and_computes_in_float32():
  target = Target.init(CONFIG, seed=0)
  assert target.precision is FAST and target.dtype == jnp.float32
  dtypes = _dtypes(target.params)
  kernels = {k: d for k, d in dtypes.items()
             if k.endswith(("kernel", "weight", "panels")) or "embedding" in k}
  norms = {k: d for k, d in dtypes.items() if "scale" in k}
  assert kernels and set(kernels.values()) == {jnp.dtype(jnp.bfloat16)}
  assert norms and set(norms.values()) == {jnp.dtype(jnp.float32)}
  assert target.new_cache(1, 8).k[0].dtype == jnp.float32
  head = dj.DartHead.init(target, draft_length=2)
  assert head.module().precision is FAST_ROWS  # drafters follow with the cheap form


def test_fast_target_matches_float32_on_the_same_weights():
  """Fast mode = float32 math on bf16-rounded weights, to float32 accuracy."""
  fast = Target.init(CONFIG, seed=0)
  # The same (bf16) weights through checkpoint tensors into a float32 target.
  graphdef, params = target_lib.params_from_hf(
      CONFIG, checkpoint.tensors_from_state(fast.params, target_lib.hf_name), "float32")
  exact = Target(CONFIG, graphdef, params, precision=FLOAT32)
  dense = exact.module().layers[0].mlp.up_proj
  assert not dense.transposed and dense.kernel.shape == (32, 64)
  fast_dense = fast.module().layers[0].mlp.up_proj
  if fast_dense.layout == "panels":
    assert fast_dense.panels.shape == (8, 32, 8)
  else:
    assert fast_dense.weight.shape == (64, 32)
  assert fast_dense.matrix().shape == (64, 32)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 97, (2, 12)), jnp.int32)
  want = dj.generate(exact, tokens.tolist(), max_new_tokens=8).tokens
  got = dj.generate(fast, tokens.tolist(), max_new_tokens=8).tokens
  assert got == want
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  logits = [t.forward(tokens, positions, t.new_cache(2, 16), causal_mask(2, 12)).logits
            for t in (fast, exact)]
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), rtol=0,
                             atol=1e-5 * float(jnp.abs(logits[1]).max()))


@pytest.mark.parametrize("bf16_unit,kernel,want", [
    (True, False, "fast"), (False, True, "fast"), (False, False, "float32")])
def test_cpu_default_is_fast_only_where_bf16_weights_pay(monkeypatch, bf16_unit, kernel,
                                                        want):
  """Without a bf16 matrix unit (AMX) XLA's bf16 dots are slower than float32 (measured
  0.84x AR on an AVX2-only CPU); with the AVX2 kernel bf16 weights halve the bytes."""
  monkeypatch.setattr(precision.cpu_matmul, "cpu_has_bf16_matrix_unit", lambda: bf16_unit)
  monkeypatch.setattr(precision.cpu_matmul, "available", lambda: kernel)
  assert precision.default().name == want
  assert precision.cpu_kernel_active() == kernel  # with AMX too: its tile path


@pytest.mark.skipif(not precision.cpu_kernel_active(), reason="needs the CPU kernel")
@pytest.mark.parametrize("mode", [FAST, FLOAT32])
def test_kernel_dots_are_bitwise_the_same_for_one_token_and_a_tree(mode):
  """Where the CPU kernel runs, a token's output of every dense layer is bitwise
  the same in a 1-token call (decode) and a 33-token call (a tree), for any batch."""
  # [out, in] weights: the fast modes' layers and tied LM heads ([in, out] keeps
  # XLA's dot, see precision._uses_cpu_kernel).
  w = jnp.asarray(np.random.default_rng(7).standard_normal((300, 96)) * 0.05,
                  mode.weight_dtype)
  x = jnp.asarray(_activations(2 * 33, 96, seed=8)).reshape(2, 33, 96)
  dot = jax.jit(lambda a: matmul(a, w, mode, transposed=True))
  tree = np.asarray(dot(x))
  for b, t in ((0, 0), (1, 5), (1, 32)):
    np.testing.assert_array_equal(np.asarray(dot(x[b:b + 1, t:t + 1]))[0, 0], tree[b, t])


@pytest.mark.skipif(not precision.panel_weights_active(),
                    reason="needs the CPU kernel's panel form (no AMX)")
def test_fast_targets_store_panels_and_checkpoints_keep_the_hf_layout():
  """Where the panel form runs, the fast mode's dense layers (and a tied LM head)
  store ``panels``; checkpoint tensors stay [out, in], and a target built with
  panels off from them has the same matrices and the same greedy tokens."""
  config = dataclasses.replace(CONFIG, vocab_size=104, tie_embeddings=True)
  target = Target.init(config, seed=0)
  up = target.module().layers[0].mlp.up_proj
  assert up.layout == "panels" and up.panels.shape == (8, 32, 8)
  assert target.dense_layout == "panels"
  assert Target.init(config, seed=0, dtype=jnp.float32).dense_layout == "kernel"
  tensors = checkpoint.tensors_from_state(target.params, target_lib.hf_name)
  assert tensors["model.layers.0.mlp.up_proj.weight"].shape == (64, 32)
  # The tied LM head is a packed copy of the embedding table, one tensor on disk.
  embedding = np.asarray(target.module().embed_tokens.embedding[...])
  np.testing.assert_array_equal(target.module().tied_head.matrix(), embedding)
  np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], embedding)
  assert not any("tied_head" in name for name in tensors)
  np.testing.assert_array_equal(tensors["model.layers.0.mlp.up_proj.weight"],
                                np.asarray(up.matrix()))
  with precision.panel_weights(False):
    graphdef, params = target_lib.params_from_hf(config, tensors, "fast")
  rows = Target(config, graphdef, params)
  assert rows.module().layers[0].mlp.up_proj.layout == "weight"
  assert rows.dense_layout == "weight"
  assert not hasattr(rows.module(), "tied_head")
  graphdef, params = target_lib.params_from_hf(config, tensors, "fast")  # panels again
  np.testing.assert_array_equal(
      Target(config, graphdef, params).module().tied_head.matrix(), embedding)
  tokens = np.random.default_rng(5).integers(0, 104, (2, 12)).tolist()
  assert (dj.generate(rows, tokens, max_new_tokens=8).tokens
          == dj.generate(target, tokens, max_new_tokens=8).tokens)
  # A tensor of the wrong shape is named, in the checkpoint's [out, in] terms.
  tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((64, 31), np.float32)
  with pytest.raises(dj.CheckpointError, match=r"up_proj.weight has shape \(64, 31\).*"
                     r"expects \(64, 32\)"):
    target_lib.params_from_hf(config, tensors, "fast")


@pytest.mark.skipif(not precision.panel_weights_active(),
                    reason="needs the CPU kernel's panel form (no AMX)")
def test_panel_dots_are_bitwise_the_same_for_one_token_and_a_tree_and_exact():
  """The panel form keeps what lossless verification needs (a token's numbers do
  not depend on the call) and float32 accuracy; past CPU_KERNEL_MAX_TOKENS XLA's
  dot reads the same panels."""
  w = jnp.asarray(np.random.default_rng(7).standard_normal((304, 96)) * 0.05, jnp.bfloat16)
  panels = precision.cpu_matmul.to_panels(w)
  x = jnp.asarray(_activations(2 * 33, 96, seed=8)).reshape(2, 33, 96)
  dot = jax.jit(lambda a: matmul(a, panels, FAST, panels=True))
  tree = np.asarray(dot(x))
  for b, t in ((0, 0), (1, 5), (1, 32)):
    np.testing.assert_array_equal(np.asarray(dot(x[b:b + 1, t:t + 1]))[0, 0], tree[b, t])
  exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
  np.testing.assert_allclose(tree, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
  long = jnp.asarray(_activations(precision.CPU_KERNEL_MAX_TOKENS + 1, 96, seed=9))
  np.testing.assert_allclose(np.asarray(jax.jit(lambda a: matmul(a, panels, FAST,
                                                                 panels=True))(long)),
                             np.asarray(long, np.float64)
                             @ np.asarray(w.astype(jnp.float32), np.float64).T,
                             rtol=0, atol=1e-5 * np.abs(exact).max() * 10)


def test_only_the_bf16_weight_modes_store_panels_and_the_switches_turn_them_off(monkeypatch):
  monkeypatch.setattr(precision, "cpu_kernel_active", lambda: True)
  monkeypatch.setattr(precision.cpu_matmul, "amx_active", lambda: False)
  monkeypatch.setattr(precision.jax, "device_count", lambda: 1)
  monkeypatch.delenv(precision.PANELS_ENV_SWITCH, raising=False)
  assert precision.weight_layout(FAST, 64) == "panels"
  assert precision.weight_layout(FAST, 60) == "weight"  # not a multiple of 8
  assert precision.weight_layout(FAST_ROWS, 64) == "panels"  # drafters
  assert precision.weight_layout(FAST_ROWS, 60) == "weight"
  assert precision.weight_layout(FLOAT32, 64) == "kernel"
  with precision.panel_weights(False):
    assert precision.weight_layout(FAST, 64) == "weight"
  monkeypatch.setenv(precision.PANELS_ENV_SWITCH, "0")
  assert precision.weight_layout(FAST, 64) == "weight"
  monkeypatch.delenv(precision.PANELS_ENV_SWITCH)
  monkeypatch.setattr(precision.cpu_matmul, "amx_active", lambda: True)  # the tile path
  assert precision.weight_layout(FAST, 64) == "weight"
  monkeypatch.setattr(precision.cpu_matmul, "amx_active", lambda: False)
  monkeypatch.setattr(precision.jax, "device_count", lambda: 8)  # sharded targets
  assert precision.weight_layout(FAST, 64) == "weight"


def _dot_operand_dtypes(fn, *args) -> set[str]:
  jaxpr = jax.make_jaxpr(fn)(*args)
  return {str(v.aval.dtype) for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"
          for v in eqn.invars}


@pytest.mark.parametrize("dot_instruction", [False, True])
def test_long_rounded_rows_use_the_bf16_dot_where_the_cpu_has_a_bf16_dot_instruction(
    monkeypatch, dot_instruction):
  """``fast-rows`` calls above the kernel's token limit (training features in
  that mode, drafters' long prompts) keep XLA's bf16 dot on an AVX512-BF16 CPU,
  where it is faster than the widened float32 dot; ``fast`` (exact) widens."""
  monkeypatch.setattr(precision.cpu_matmul, "cpu_has_bf16_matrix_unit", lambda: False)
  monkeypatch.setattr(precision.cpu_matmul, "cpu_has_bf16_dot_instruction",
                      lambda: dot_instruction)
  tokens = precision.CPU_KERNEL_MAX_TOKENS + 1
  w = jnp.asarray(np.random.default_rng(11).standard_normal((40, 96)) * 0.05, jnp.bfloat16)
  x = jnp.asarray(_activations(tokens, 96, seed=12))[None]
  rows = lambda a: matmul(a, w, FAST_ROWS, transposed=True)
  exact = lambda a: matmul(a, w, FAST, transposed=True)
  assert _dot_operand_dtypes(rows, x) == ({"bfloat16"} if dot_instruction else {"float32"})
  assert _dot_operand_dtypes(exact, x) == {"float32"}
  if dot_instruction:
    want = jax.lax.dot_general(x[0].astype(jnp.bfloat16), w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(rows)(x))[0], np.asarray(want))


@pytest.mark.parametrize("bf16_unit", [False, True])
def test_long_calls_widen_bf16_weights_only_without_a_bf16_matrix_unit(monkeypatch, bf16_unit):
  """Above the kernel's token limit (prefill, training features) a CPU without a
  bf16 matrix unit runs the float32 dot of the exactly widened weights (XLA:CPU's
  bf16 dots have no fast path there); with one, the split3 bf16 dot."""
  monkeypatch.setattr(precision.cpu_matmul, "cpu_has_bf16_matrix_unit", lambda: bf16_unit)
  tokens = precision.CPU_KERNEL_MAX_TOKENS + 1
  w = jnp.asarray(np.random.default_rng(9).standard_normal((40, 96)) * 0.05, jnp.bfloat16)
  x = jnp.asarray(_activations(tokens, 96, seed=10))[None]  # [1, T, K]
  dot = lambda a: matmul(a, w, FAST, transposed=True)
  assert _dot_operand_dtypes(dot, x) == ({"bfloat16"} if bf16_unit else {"float32"})
  if not bf16_unit:
    want = jax.lax.dot_general(x[0], w.astype(jnp.float32), (((1,), (1,)), ((), ())))
    np.testing.assert_array_equal(np.asarray(jax.jit(dot)(x))[0], np.asarray(want))
