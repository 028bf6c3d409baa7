"""Pallas tree-attention kernels (TPU and GPU) in interpret mode vs the jnp reference.

Interpret mode checks semantics (indexing, masking, online softmax, DMA/loop
bounds) on CPU; it says nothing about speed. Each case costs one XLA compile of
the interpreted kernel (~5 s), so the cases are few and each covers several
requirements.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.tree_attention import pallas_gpu
from kernels.tree_attention import pallas_tpu
from kernels.tree_attention import tree_attention
from kernels.tree_attention import tree_attention_reference
from tests.kernels.test_tree_attention import random_inputs

_KERNELS = {
    "pallas_tpu": pallas_tpu.tree_attention_pallas_tpu,
    "pallas_gpu": pallas_gpu.tree_attention_pallas_gpu,
}

# shape: (B, T, Hq, Hkv, hd, S). Per-kernel block options make the small shapes
# span several cache / row / tree blocks with partial last blocks.
CASES = {
    # GQA 3, f32, length 0 and a length (277) that is no multiple of the block;
    # the TPU's last cache block is shifted back in bounds; GPU split-K over 3.
    "gqa3_f32_len0": dict(
        shape=(2, 13, 6, 2, 64, 300), lengths=[0, 277], dtype=jnp.float32,
        empty_row=True, pallas_tpu=dict(block_kv=128), pallas_gpu=dict(num_splits=3)),
    # Decode (T=1), GQA 8, bf16, batch 3 with different lengths (one = S).
    "decode_gqa8_bf16": dict(
        shape=(3, 1, 8, 1, 32, 200), lengths=[5, 200, 129], dtype=jnp.bfloat16,
        pallas_tpu=dict(block_kv=128), pallas_gpu={}),
    # T=128, MHA (GQA 1), f32: several row blocks and tree blocks.
    "verify_t128_mha_f32": dict(
        shape=(1, 128, 2, 2, 32, 160), lengths=[150], dtype=jnp.float32,
        pallas_tpu=dict(block_rows=64), pallas_gpu=dict(block_tree=32)),
    # Prefill (causal) through the public entry point, bf16 in and out, GQA 3,
    # one row with an empty cache and one with 37 cached tokens.
    "prefill_causal_bf16_entry": dict(
        shape=(2, 40, 6, 2, 64, 96), lengths=[0, 37], dtype=jnp.bfloat16,
        mask="causal", entry=True),
    # Causal T=136 over 2 TPU tree blocks (128 lanes each): blocks above the
    # diagonal are skipped; q float32 with bf16 caches; a custom scale.
    "skip_tree_blocks_mixed_dtype": dict(
        shape=(1, 136, 1, 1, 32, 50), lengths=[17], dtype=jnp.bfloat16,
        q_dtype=jnp.float32, mask="causal", scale=0.3,
        pallas_tpu=dict(block_rows=64, block_tree=128),
        pallas_gpu=dict(block_rows=32, block_tree=32)),
}


def _to_f32(x: jax.Array) -> jax.Array:
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


# The backend each kernel runs on natively (``tools/gpu_check.sh`` runs these).
_NATIVE_BACKEND = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


@pytest.mark.parametrize("interpret", [True, False], ids=["interpret", "native"])
@pytest.mark.parametrize("impl", list(_KERNELS))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case, impl, interpret):
  if not interpret and jax.default_backend() != _NATIVE_BACKEND[impl]:
    pytest.skip(f"{impl} runs natively on {_NATIVE_BACKEND[impl]}, not "
                f"{jax.default_backend()}")
  spec = CASES[case]
  args = list(random_inputs(*spec["shape"], spec["lengths"], spec["dtype"],
                            seed=len(case), mask=spec.get("mask", "tree")))
  if "q_dtype" in spec:
    args[0] = args[0].astype(spec["q_dtype"])
  if spec.get("empty_row"):  # Row 0 has no cache; its token 4 sees no tree token.
    args[6] = args[6].at[0, 4, :].set(False)
  scale = spec.get("scale")
  # Ground truth in float32 on the same (possibly bf16-rounded) input values.
  expected = np.asarray(tree_attention_reference(*map(_to_f32, args), scale=scale))

  if spec.get("entry"):
    run = functools.partial(tree_attention, impl=impl, scale=scale, interpret=interpret)
  else:
    run = jax.jit(functools.partial(_KERNELS[impl], scale=scale, interpret=interpret,
                                    out_dtype=jnp.float32, **spec[impl]))
  out = run(*args)
  assert out.shape == args[0].shape

  low_precision = all(a.dtype == jnp.bfloat16 for a in args[:3])
  if out.dtype == jnp.bfloat16:
    # 2e-3 plus the unavoidable rounding of the output to bf16 (half an ulp).
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=2e-3,
                               rtol=2.0**-8)
  else:
    np.testing.assert_allclose(np.asarray(out), expected,
                               atol=2e-3 if low_precision else 1e-5, rtol=0)
  if spec.get("empty_row"):
    np.testing.assert_array_equal(np.asarray(out[0, 4]), 0.0)


@pytest.mark.parametrize("impl,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
@pytest.mark.parametrize("shape,lengths", [
    ((1, 61, 32, 8, 128, 4096), [1000]),  # Tree verify, GQA 4, hd 128.
    ((2, 1, 8, 1, 64, 2048), [5, 2000]),  # Decode, GQA 8, hd 64 (GPU split-K).
])
def test_kernel_lowers_for_its_hardware(impl, platform, shape, lengths):
  """Cross-lowers (no device needed) so Pallas -> Mosaic / Triton errors show on CPU.

  Only the Pallas-level lowering runs here; Mosaic's layout passes and Triton's
  compiler run on the device and are not covered.
  """
  args = random_inputs(*shape, lengths, jnp.bfloat16)
  run = jax.jit(functools.partial(tree_attention, impl=impl))
  exported = jax.export.export(
      run, platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          "__gpu$xla.gpu.triton")])(*args)
  text = exported.mlir_module()
  assert ("tpu_custom_call" if platform == "tpu" else "triton") in text
