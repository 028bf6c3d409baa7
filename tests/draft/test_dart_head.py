"""DART head: forward semantics, reference checkpoint format, bad input."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dart_jax as dj
from dart_jax.draft.dart_head import DartHead
from dart_jax.models import ModelConfig, Target, precision
from dart_jax.models.transformer import KVCache

TINY = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                   num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def target():
  # Float32: these tests check exact round trips and a numpy forward pass.
  return Target.init(TINY, seed=0, dtype=jnp.float32)


def _reference_dir(tmp_path, rng, hidden=32, vocab=64, draft_vocab=40, d=3, heads=4,
                   kv=2, hd=8, inter=48, target_hidden=32):
  """A head directory written with the reference release's names and layout."""
  w = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.05
  used = np.sort(rng.choice(vocab, draft_vocab, replace=False))
  t2d = np.zeros(vocab, bool)
  t2d[used] = True
  tensors = {
      "fc.weight": w(hidden, 3 * target_hidden),
      "midlayer.mask_rep": w(2 * hidden),
      "midlayer.hidden_norm.weight": 1 + w(hidden),
      "midlayer.input_layernorm.weight": 1 + w(hidden),
      "midlayer.post_attention_layernorm.weight": 1 + w(hidden),
      "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * hidden),
      "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * hidden),
      "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * hidden),
      "midlayer.self_attn.o_proj.weight": w(hidden, heads * hd),
      "midlayer.mlp.gate_proj.weight": w(inter, hidden),
      "midlayer.mlp.up_proj.weight": w(inter, hidden),
      "midlayer.mlp.down_proj.weight": w(hidden, inter),
      "norm.weight": 1 + w(hidden),
      "lm_head.weight": w(draft_vocab, hidden),
      "d2t": (used - np.arange(draft_vocab)).astype(np.int64),
      "t2d": t2d,
  }
  config = {
      "architectures": ["LlamaForCausalLMDart"], "model_type": "llama",
      "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
      "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1,
      "vocab_size": vocab, "draft_vocab_size": draft_vocab, "draft_length": d,
      "target_hidden_size": target_hidden, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
      "hidden_act": "silu",
  }
  tmp_path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(config))
  return tensors


def test_reference_format_round_trip_is_exact(tmp_path, target):
  rng = np.random.default_rng(0)
  ref = _reference_dir(tmp_path / "ref", rng)
  head = dj.load_dart(tmp_path / "ref", target)
  assert head.config.draft_length == 3 and head.config.draft_vocab_size == 40
  assert head.config.tap_layers == (2, 2, 1)  # 2, L//2, L-3 for L=4
  dj.save_dart(head, tmp_path / "out")
  back = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert set(back) == set(ref)
  for name, value in ref.items():
    assert back[name].dtype == value.dtype, name
    np.testing.assert_array_equal(back[name], value, err_msg=name)


def _numpy_head_forward(t, taps, next_emb, d, double_norm=True):
  """Spec section 2 written out in numpy for one sequence with an empty cache."""
  def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w

  def rope(x, pos, hd):
    inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))
    ang = pos[:, None] * inv[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

  h = t["fc.weight"].shape[0]
  g = taps @ t["fc.weight"].T
  a = np.concatenate([rms(next_emb, t["midlayer.input_layernorm.weight"]),
                      rms(g, t["midlayer.hidden_norm.weight"])], -1)
  a = np.concatenate([a, np.tile(t["midlayer.mask_rep"], (d, 1))])
  r = np.concatenate([g, np.tile(t["midlayer.mask_rep"][:h], (d, 1))])
  n = a.shape[0]
  pos = np.arange(n, dtype=np.float64)
  hd = 8
  q = rope((a @ t["midlayer.self_attn.q_proj.weight"].T).reshape(n, -1, hd), pos, hd)
  k = rope((a @ t["midlayer.self_attn.k_proj.weight"].T).reshape(n, -1, hd), pos, hd)
  v = (a @ t["midlayer.self_attn.v_proj.weight"].T).reshape(n, -1, hd)
  group = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
  s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
  s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  att = np.einsum("hij,jhd->ihd", p, v).reshape(n, -1)
  x = r + att @ t["midlayer.self_attn.o_proj.weight"].T
  x = x[-(d + 1):]
  m = rms(x, t["midlayer.post_attention_layernorm.weight"])
  silu = lambda z: z / (1 + np.exp(-z))
  x = x + (silu(m @ t["midlayer.mlp.gate_proj.weight"].T) *
           (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
  x = rms(x, t["norm.weight"])
  if double_norm:
    x = rms(x, t["norm.weight"])
  return x @ t["lm_head.weight"].T


def test_forward_matches_numpy_spec_and_is_batch_consistent(tmp_path, target):
  rng = np.random.default_rng(1)
  ref = {k: v.astype(np.float64) if v.dtype == np.float32 else v
         for k, v in _reference_dir(tmp_path, rng).items()}
  head = dj.load_dart(tmp_path, target)
  module = head.module()
  s_real = [5, 2]
  taps = rng.standard_normal((2, 5, 96)).astype(np.float32)
  emb = rng.standard_normal((2, 5, 32)).astype(np.float32)
  cache = KVCache.create(1, 2, 16, 2, 8)
  logits, _ = module(jnp.asarray(taps), jnp.asarray(emb), jnp.asarray(s_real), cache)
  for b, s in enumerate(s_real):
    want = _numpy_head_forward(ref, taps[b, :s].astype(np.float64),
                               emb[b, :s].astype(np.float64), 3)
    np.testing.assert_allclose(np.asarray(logits[b]), want, atol=2e-4, rtol=1e-4)


def test_incremental_cache_equals_one_pass(target):
  """Real rows fed in two calls (cache cut back to real rows) give the same drafts."""
  head = DartHead.init(target, draft_length=2, seed=3)
  module = head.module()
  rng = np.random.default_rng(2)
  taps = jnp.asarray(rng.standard_normal((1, 6, 96)), jnp.float32)
  emb = jnp.asarray(rng.standard_normal((1, 6, 32)), jnp.float32)
  one, _ = module(taps, emb, jnp.asarray([6]), KVCache.create(1, 1, 16, 2, 8))
  first, cache = module(taps[:, :4], emb[:, :4], jnp.asarray([4]),
                        KVCache.create(1, 1, 16, 2, 8))
  cache = cache.replace(lengths=cache.lengths + 4)
  second, _ = module(taps[:, 4:], emb[:, 4:], jnp.asarray([2]), cache)
  np.testing.assert_allclose(second, one, atol=1e-5)
  assert not np.allclose(first, one, atol=1e-3)


def test_head_for_another_target_is_rejected(tmp_path, target):
  rng = np.random.default_rng(0)
  _reference_dir(tmp_path / "v", rng, vocab=80)
  with pytest.raises(dj.ConfigError, match="vocab"):
    dj.load_dart(tmp_path / "v", target)
  _reference_dir(tmp_path / "h", rng, target_hidden=48)
  with pytest.raises(dj.ConfigError, match="hidden"):
    dj.load_dart(tmp_path / "h", target)


def test_missing_and_corrupt_head_files(tmp_path, target):
  with pytest.raises(dj.CheckpointError, match="nowhere"):
    dj.load_dart(tmp_path / "nowhere", target)
  _reference_dir(tmp_path / "c", np.random.default_rng(0))
  data = (tmp_path / "c" / "model.safetensors").read_bytes()
  (tmp_path / "c" / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(dj.CheckpointError):
    dj.load_dart(tmp_path / "c", target)


def test_draft_vocab_mapping(target):
  head = DartHead.init(target, draft_length=1, draft_vocab_size=5)
  head = head.with_draft_vocab([40, 3, 7, 11, 63])
  d2t = np.asarray(head.params["d2t"][...])
  np.testing.assert_array_equal(np.arange(5) + d2t, [3, 7, 11, 40, 63])
  t2d = np.asarray(head.params["t2d"][...])
  assert t2d.sum() == 5 and t2d[[3, 7, 11, 40, 63]].all()
  with pytest.raises(dj.ConfigError):
    head.with_draft_vocab([1, 1, 2, 3, 4])


@pytest.mark.parametrize("mode", ["fast", "fast-rows"])
def test_loads_and_saves_in_the_bf16_modes(tmp_path, target, mode):
  """A head loads in either CPU bf16 mode (both store their dense layers as
  panels where the kernel's panel form runs) and saves back the reference
  tensors, rounded to bf16."""
  rng = np.random.default_rng(1)
  ref = _reference_dir(tmp_path / "ref", rng)
  head = dj.load_dart(tmp_path / "ref", target, dtype=mode)
  fc = head.module().fc  # 32 outputs: a whole number of panels
  assert fc.layout == ("panels" if precision.panel_weights_active() else "weight")
  dj.save_dart(head, tmp_path / "out")
  back = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert set(back) == set(ref)
  for name, value in ref.items():
    if value.dtype == np.float32 and value.ndim == 2:  # dense weights: stored bf16
      np.testing.assert_allclose(back[name], value, rtol=2 ** -8, atol=0, err_msg=name)
