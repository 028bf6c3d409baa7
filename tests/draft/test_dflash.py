"""DFlash drafter + Domino head: released checkpoint format, forward semantics, errors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import dart_jax as dj
from tests.helpers import shape_only_target
from dart_jax.draft.dflash import (DFlashConfig, default_target_layer_ids, draft_block,
                                   released_name)
from dart_jax.models import ModelConfig, Target
from dart_jax.models.transformer import KVCache

TARGET = ModelConfig(arch="qwen3", vocab_size=97, hidden_size=32, intermediate_size=48,
                     num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     tie_embeddings=True, max_position_embeddings=256)
DIMS = dict(hidden=32, heads=4, kv=2, hd=8, inter=40, layers=2, vocab=97, block=4,
            ids=(1, 3), num_target=4, emb=12, gru=10, mask=96)


@pytest.fixture(scope="module")
def target():
  # Float32: exact round trips and a numpy forward pass.
  return Target.init(TARGET, seed=0, dtype="float32")


def released_dir(path, rng, domino=True, **overrides):
  """A drafter directory with the released parameter names, shapes and config keys
  (``z-lab/Qwen3-*-DFlash-b16``; Domino adds ``prefix_gru`` and ``embed_proj``)."""
  d = {**DIMS, **overrides}
  w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)
  h, n = d["hidden"], len(d["ids"])
  tensors = {"fc.weight": w(h, n * h), "hidden_norm.weight": 1 + w(h),
             "norm.weight": 1 + w(h)}
  for i in range(d["layers"]):
    p = f"layers.{i}."
    tensors.update({
        p + "input_layernorm.weight": 1 + w(h),
        p + "post_attention_layernorm.weight": 1 + w(h),
        p + "self_attn.q_proj.weight": w(d["heads"] * d["hd"], h),
        p + "self_attn.k_proj.weight": w(d["kv"] * d["hd"], h),
        p + "self_attn.v_proj.weight": w(d["kv"] * d["hd"], h),
        p + "self_attn.o_proj.weight": w(h, d["heads"] * d["hd"]),
        p + "self_attn.q_norm.weight": 1 + w(d["hd"]),
        p + "self_attn.k_norm.weight": 1 + w(d["hd"]),
        p + "mlp.gate_proj.weight": w(d["inter"], h),
        p + "mlp.up_proj.weight": w(d["inter"], h),
        p + "mlp.down_proj.weight": w(h, d["inter"]),
    })
  dflash = {"mask_token_id": d["mask"], "target_layer_ids": list(d["ids"])}
  if domino:
    g = d["gru"]
    tensors.update({
        "prefix_gru.weight_ih_l0": w(3 * g, h), "prefix_gru.weight_hh_l0": w(3 * g, g),
        "embed_proj.0.weight": w(d["emb"], h + g),
        "embed_proj.2.weight": w(d["vocab"], d["emb"]),
    })
    dflash.update(projector_type="domino", emb_dim=d["emb"], gru_hidden_dim=g,
                  pure_draft_prefix_len=0)
  config = {
      "architectures": ["DFlashDraftModel"],
      "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
      "attention_bias": False, "attention_dropout": 0.0, "block_size": d["block"],
      "dflash_config": dflash, "dtype": "bfloat16", "head_dim": d["hd"],
      "hidden_act": "silu", "hidden_size": h, "initializer_range": 0.02,
      "intermediate_size": d["inter"], "layer_types": ["full_attention"] * d["layers"],
      "max_position_embeddings": 40960, "max_window_layers": d["layers"],
      "model_type": "qwen3", "num_attention_heads": d["heads"],
      "num_hidden_layers": d["layers"], "num_key_value_heads": d["kv"],
      "num_target_layers": d["num_target"], "rms_norm_eps": 1e-06, "rope_scaling": None,
      "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
      "use_cache": True, "use_sliding_window": False, "vocab_size": d["vocab"],
  }
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(config))
  return tensors, config


def test_released_domino_dir_loads_and_round_trips_exactly(tmp_path, target):
  rng = np.random.default_rng(0)
  ref, _ = released_dir(tmp_path / "ref", rng)
  drafter = dj.load_domino(tmp_path / "ref", target)
  c = drafter.config
  assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_layers) == (4, 96, (1, 3), 2)
  assert (c.emb_dim, c.gru_hidden_dim, c.rope_theta, c.taps) == (12, 10, 1e6, (2, 4))
  assert drafter.domino and c.num_depths == 3
  # Layouts: linear kernels are [in, out], the GRU kernels torch's transposed.
  m = drafter.module()
  np.testing.assert_array_equal(m.fc.kernel[...], ref["fc.weight"].T)
  np.testing.assert_array_equal(m.prefix_gru.input_kernel[...],
                                ref["prefix_gru.weight_ih_l0"].T)
  np.testing.assert_array_equal(m.embed_proj_out.kernel[...], ref["embed_proj.2.weight"].T)
  np.testing.assert_array_equal(m.layers[1].self_attn.k_norm.scale[...],
                                ref["layers.1.self_attn.k_norm.weight"])
  dj.save_dflash(drafter, tmp_path / "out")
  back = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert set(back) == set(ref)
  for name, value in ref.items():
    assert back[name].dtype == value.dtype, name
    np.testing.assert_array_equal(back[name], value, err_msg=name)
  again = dj.load_domino(tmp_path / "out", target)
  assert again.config == drafter.config
  saved = json.loads((tmp_path / "out" / "config.json").read_text())
  assert saved["dflash_config"]["projector_type"] == "domino"
  assert saved["block_size"] == 4 and saved["architectures"] == ["DFlashDraftModel"]


def test_plain_dflash_dir_and_default_target_layers(tmp_path, target):
  rng = np.random.default_rng(1)
  ref, config = released_dir(tmp_path / "a", rng, domino=False)
  drafter = dj.load_dflash(tmp_path / "a", target)
  assert not drafter.domino and not hasattr(drafter.module(), "prefix_gru")
  dj.save_dflash(drafter, tmp_path / "b")
  assert set(load_file(str(tmp_path / "b" / "model.safetensors"))) == set(ref)
  # Without target_layer_ids: DFlash's default rule round(1 + i*(L-4)/(n-1)).
  del config["dflash_config"]["target_layer_ids"]
  (tmp_path / "a" / "config.json").write_text(json.dumps(config))
  assert dj.load_dflash(tmp_path / "a", target).config.target_layer_ids == (1, 1)
  assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert default_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)
  assert default_target_layer_ids(36, 1) == (18,)
  for layers in (1, 2, 3, 4, 6):
    ids = default_target_layer_ids(layers, 5)
    assert len(ids) == 5 and all(0 <= i < layers for i in ids), (layers, ids)


def _rms(x, w, eps=1e-6):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
  hd = x.shape[-1]
  inv = 1.0 / (theta ** (np.arange(0, hd, 2) / hd))
  ang = pos[:, None] * inv[None]
  c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
  x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def numpy_dflash(t, d, taps, block_embeds, lm_head, theta=1e6):
  """Spec section 1 for one sequence: C context positions 0..C-1, the block at
  C..C+B-1; queries from the block, K/V from concat(ctx, block), no mask."""
  hd, nc, nb = d["hd"], taps.shape[0], block_embeds.shape[0]
  ctx = _rms(taps @ t["fc.weight"].T, t["hidden_norm.weight"])
  pos_ctx, pos_blk = np.arange(nc, dtype=np.float64), np.arange(nc, nc + nb, dtype=np.float64)
  x = block_embeds
  silu = lambda z: z / (1 + np.exp(-z))
  for i in range(d["layers"]):
    p = lambda n: t[f"layers.{i}.{n}"]
    h = _rms(x, p("input_layernorm.weight"))
    q = _rms((h @ p("self_attn.q_proj.weight").T).reshape(nb, -1, hd),
             p("self_attn.q_norm.weight"))
    k = np.concatenate([ctx, h]) @ p("self_attn.k_proj.weight").T
    k = _rms(k.reshape(nc + nb, -1, hd), p("self_attn.k_norm.weight"))
    v = (np.concatenate([ctx, h]) @ p("self_attn.v_proj.weight").T).reshape(nc + nb, -1, hd)
    q = _rope(q, pos_blk, theta)
    k = _rope(k, np.concatenate([pos_ctx, pos_blk]), theta)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("hij,jhd->ihd", a, v).reshape(nb, -1) @ p("self_attn.o_proj.weight").T
    m = _rms(x, p("post_attention_layernorm.weight"))
    x = x + (silu(m @ p("mlp.gate_proj.weight").T) * (m @ p("mlp.up_proj.weight").T)
             ) @ p("mlp.down_proj.weight").T
  hid = _rms(x, t["norm.weight"])[1:]
  return hid @ lm_head.T, hid


def numpy_gru(t, x, s):
  """torch.nn.GRU (one layer, no bias, gates r, z, n) on one input."""
  g = s.shape[0]
  gi, gh = t["prefix_gru.weight_ih_l0"] @ x, t["prefix_gru.weight_hh_l0"] @ s
  sig = lambda z: 1 / (1 + np.exp(-z))
  r, z = sig(gi[:g] + gh[:g]), sig(gi[g:2 * g] + gh[g:2 * g])
  n = np.tanh(gi[2 * g:] + r * gh[2 * g:])
  return (1 - z) * n + z * s


def test_forward_matches_numpy_spec_with_incremental_context(tmp_path, target):
  """Context written in two chunks (the second right-padded, as rounds do), then
  the block: equals the spec computed at once; Domino's corrected logits along a
  path equal a torch-layout GRU + embed_proj in numpy."""
  rng = np.random.default_rng(2)
  t, _ = released_dir(tmp_path / "d", rng)
  drafter = dj.load_domino(tmp_path / "d", target)
  m, tm = drafter.module(), target.module()
  num_ctx, root = 7, 11
  taps = rng.standard_normal((1, num_ctx + 2, 2 * 32)).astype(np.float32)
  cache = KVCache.create(2, 1, 32, 2, 8)
  cache = m.write_context(jnp.asarray(taps[:, :3]), cache)
  cache = cache.replace(lengths=cache.lengths + 3)
  cache = m.write_context(jnp.asarray(taps[:, 3:]), cache)  # 6 rows, 4 real
  cache = cache.replace(lengths=cache.lengths + 4)
  logits, hidden, _ = draft_block(tm, m, jnp.asarray([root]), cache, attend_len=None,
                                  attn_impl="xla")
  embed = np.asarray(tm.embed_tokens.embedding[...])
  block = embed[[root] + [96] * 3]
  want_logits, want_hid = numpy_dflash(t, DIMS, taps[0, :num_ctx].astype(np.float64),
                                       block.astype(np.float64), embed)
  np.testing.assert_allclose(np.asarray(logits[0]), want_logits, atol=2e-4, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(hidden[0]), want_hid, atol=2e-5, rtol=1e-4)
  # Correction head: logits_d(x|path) = base + W2[x] . SiLU(W_z hid + W_s s).
  head = m.correction_head(tm.embed_tokens.embedding[...], hidden[0])
  path = [root, 5, 42]
  s = numpy_gru(t, embed[root].astype(np.float64), np.zeros(10))
  state = head.root_state(jnp.int32(root))
  for depth in range(1, 4):
    proj = t["embed_proj.0.weight"] @ np.concatenate([want_hid[depth - 1], s])
    want = want_logits[depth - 1] + t["embed_proj.2.weight"] @ (proj / (1 + np.exp(-proj)))
    got = logits[0, depth - 1] + head.full_bias(depth - 1, state)
    np.testing.assert_allclose(np.asarray(got), want, atol=3e-4, rtol=1e-4)
    if depth < 3:
      s = numpy_gru(t, embed[path[depth]].astype(np.float64), s)
      state = head.gru(jnp.asarray([path[depth]]), state[None])[0]


def test_random_init_shapes_and_released_names(target):
  drafter = dj.DFlashDrafter.init(target, block_size=5, num_layers=3, domino=True,
                                  emb_dim=8, gru_hidden_dim=6, seed=1)
  c = drafter.config
  assert c.mask_token_id == 96 and c.target_layer_ids == (1, 1, 1)
  names = {released_name("/".join(map(str, p))) for p, _ in
           nnx.to_flat_state(drafter.params)}
  assert {"prefix_gru.weight_ih_l0", "embed_proj.0.weight", "embed_proj.2.weight",
          "layers.2.self_attn.q_norm.weight", "fc.weight"} <= names
  assert c == DFlashConfig.from_hf(c.to_hf())


def _edit(tmp_path, name, **changes):
  rng = np.random.default_rng(3)
  tensors, config = released_dir(tmp_path / name, rng)
  for key, value in changes.items():
    if key.startswith("t:"):
      tensors[key[2:]] = value
    elif key.startswith("c:"):
      config[key[2:]] = value
    elif key.startswith("d:"):
      config["dflash_config"][key[2:]] = value
  save_file(tensors, str(tmp_path / name / "model.safetensors"))
  (tmp_path / name / "config.json").write_text(json.dumps(config))
  return tmp_path / name


def test_bad_or_mismatched_drafters_raise_clear_errors(tmp_path, target):
  with pytest.raises(dj.CheckpointError, match="does not exist"):
    dj.load_dflash(tmp_path / "nowhere", target)
  with pytest.raises(dj.ConfigError, match="target_layer_ids.*out of range"):
    dj.load_dflash(_edit(tmp_path, "ids", **{"d:target_layer_ids": [1, 4]}), target)
  with pytest.raises(dj.ConfigError, match=r"target_layer_ids \[1, 5\] vs 4 target"):
    dj.load_dflash(_edit(tmp_path, "ids2", **{"d:target_layer_ids": [1, 5],
                                              "c:num_target_layers": 8}), target)
  with pytest.raises(dj.ConfigError, match="num_target_layers 8 vs 4"):
    dj.load_dflash(_edit(tmp_path, "nt", **{"c:num_target_layers": 8}), target)
  with pytest.raises(dj.ConfigError, match="mask_token_id"):
    dj.load_dflash(_edit(tmp_path, "mask", **{"d:mask_token_id": 97}), target)
  with pytest.raises(dj.ConfigError, match="missing required key 'block_size'"):
    dj.load_dflash(_edit(tmp_path, "bs", **{"c:block_size": None}), target)
  with pytest.raises(dj.ConfigError, match="projector_type"):
    dj.load_dflash(_edit(tmp_path, "proj", **{"d:projector_type": "mlp"}), target)
  with pytest.raises(dj.CheckpointError, match=r"embed_proj.2.weight has shape \(50, 12\)"):
    dj.load_domino(_edit(tmp_path, "w2", **{"t:embed_proj.2.weight":
                                            np.zeros((50, 12), np.float32)}), target)
  other = shape_only_target(ModelConfig(arch="qwen3", vocab_size=97, hidden_size=48,
                                        intermediate_size=48, num_layers=4, num_heads=4,
                                        num_kv_heads=2, head_dim=12, qk_norm=True))
  with pytest.raises(dj.ConfigError, match="hidden size 32 vs target 48"):
    dj.load_domino(tmp_path / "nt", other)
  small_vocab = shape_only_target(ModelConfig(
      arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4,
      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True))
  good = _edit(tmp_path, "good")
  with pytest.raises(dj.ConfigError, match="vocab 97 vs target 96"):
    dj.load_domino(good, small_vocab)
  plain = tmp_path / "plain"
  released_dir(plain, np.random.default_rng(4), domino=False)
  with pytest.raises(dj.ConfigError, match="not 'domino'"):
    dj.load_domino(plain, target)
  (good / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
  with pytest.raises(dj.ConfigError, match="no 'dflash_config'"):
    dj.load_dflash(good, target)


def test_masked_training_forward_equals_the_cached_inference_path(tmp_path, target):
  """Two blocks in one masked pass (DFlash's training mask: context before the
  anchor, own block bidirectionally) equal two separate inference passes."""
  from dart_jax.draft.dflash import dflash_block_mask

  rng = np.random.default_rng(5)
  released_dir(tmp_path / "d", rng)
  drafter = dj.load_domino(tmp_path / "d", target)
  m, tm = drafter.module(), target.module()
  taps = jnp.asarray(rng.standard_normal((1, 9, 64)).astype(np.float32))
  anchors = np.array([[3, 7]])
  block_ids = jnp.asarray(rng.integers(0, 96, (1, 8)))
  positions = jnp.asarray((anchors[:, :, None] + np.arange(4)).reshape(1, 8))
  mask = dflash_block_mask(jnp.asarray(anchors), 9, 4)
  assert mask.shape == (1, 8, 17) and bool(mask[0, 4, 6]) and not bool(mask[0, 4, 7])
  assert not bool(mask[0, 0, 9 + 4]) and bool(mask[0, 5, 9 + 7])
  hidden = m.forward_masked(taps, tm.embed(block_ids), positions, mask)
  for j, anchor in enumerate(anchors[0]):
    cache = KVCache.create(2, 1, 16, 2, 8)
    cache = m.write_context(taps[:, :anchor], cache)
    cache = cache.replace(lengths=cache.lengths + anchor)
    want, _ = m.block(tm.embed(block_ids[:, 4 * j:4 * j + 4]), cache, attn_impl="xla")
    np.testing.assert_allclose(np.asarray(hidden[:, 4 * j:4 * j + 4]), np.asarray(want),
                               atol=2e-5, rtol=1e-4)
