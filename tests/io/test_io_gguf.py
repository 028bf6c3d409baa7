"""GGUF loading: the embedded SmolLM2 file, tiny written files, bad inputs."""

import json
import math
import pathlib

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from dart_jax.errors import CheckpointError, ConfigError
from dart_jax.io import Tokenizer, embedded_gguf_path, read_gguf
from dart_jax.io import default_model, gguf_io, read_safetensors_dir
from tests.io.test_io_tokenizer import byte_alphabet
from tests.helpers import FIXTURES

FIXTURE = FIXTURES / "smollm2_gguf_greedy.json"

# ------------------------------------------------------------ tiny GGUF files

TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# "xyz" has no merge path: only a whole-word lookup (Llama 3 style) finds it.
TINY_TOKENS = TINY_SPECIALS + byte_alphabet() + ["he", "Ġt", "Ġthe", "12", "123", "34",
                                                 "xyz", "<think>"]
# "3 4" ranks before "12 3": "1234" as one pre-token merges to 12|34, while
# Llama 3's digit groups "123"|"4" give 123|4.
TINY_MERGES = ["h e", "Ġ t", "Ġt he", "1 2", "3 4", "12 3"]
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                 "assistant\n{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """What llama.cpp's converter does to q/k rows (HF -> GGUF order)."""
  out = w.shape[0]
  return (w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def tiny_hf_weights(seed: int = 0, untied: bool = True) -> dict[str, np.ndarray]:
  """Random float32 weights of a tiny Llama, by HF name, HF layout [out, in]."""
  rng = np.random.default_rng(seed)
  h, f, q, kv = (TINY["hidden"], TINY["ffn"], TINY["heads"] * TINY["head_dim"],
                 TINY["kv_heads"] * TINY["head_dim"])
  shapes = {"model.embed_tokens.weight": (len(TINY_TOKENS), h), "model.norm.weight": (h,)}
  if untied:
    shapes["lm_head.weight"] = (len(TINY_TOKENS), h)
  for i in range(TINY["layers"]):
    p = f"model.layers.{i}."
    shapes.update({
        p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
        p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,)})
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
  fixed = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
  if hf_name in fixed:
    return fixed[hf_name]
  _, _, layer, *part, kind = hf_name.split(".")
  return f"blk.{layer}.{GGUF_NAMES['.'.join(part)]}.{kind}"


def write_tiny_gguf(path, weights=None, *, arch="llama", raw=None, extra=None,
                    tokenizer_model="gpt2", extra_tensors=None, pre="smollm",
                    add_bos=False):
  """Writes a tiny Llama GGUF.

  Args:
    weights: HF-named float32 weights (written F32, q/k permuted as llama.cpp does).
    raw: GGUF name -> (bytes array [rows, row_bytes], quant type) replacing weights.
    extra: callable(writer) adding or overriding metadata.
    extra_tensors: GGUF name -> float32 array added as is.
    pre: ``tokenizer.ggml.pre``; add_bos: ``tokenizer.ggml.add_bos_token``
      (None leaves the key out).
  """
  weights = tiny_hf_weights() if weights is None else weights
  raw = raw or {}
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(TINY["layers"])
  writer.add_context_length(128)
  writer.add_embedding_length(TINY["hidden"])
  writer.add_feed_forward_length(TINY["ffn"])
  writer.add_head_count(TINY["heads"])
  writer.add_head_count_kv(TINY["kv_heads"])
  writer.add_rope_dimension_count(TINY["head_dim"])
  writer.add_rope_freq_base(500000.0)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_tokenizer_model(tokenizer_model)
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(TINY_TOKENS)
  writer.add_token_merges(TINY_MERGES)
  writer.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 4) + [4])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  if add_bos is not None:
    writer.add_add_bos_token(add_bos)
  writer.add_chat_template(TINY_TEMPLATE)
  if extra:
    extra(writer)
  for hf_name, w in weights.items():
    name = gguf_name(hf_name)
    if name in raw:
      data, qtype = raw[name]
      writer.add_tensor(name, data, raw_dtype=qtype)
      continue
    if ".attn_q." in name:
      w = llama_cpp_permute(w, TINY["heads"])
    elif ".attn_k." in name:
      w = llama_cpp_permute(w, TINY["kv_heads"])
    writer.add_tensor(name, np.ascontiguousarray(w))
  for name, w in (extra_tensors or {}).items():
    writer.add_tensor(name, w)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return pathlib.Path(path)


def test_tiny_f32_round_trip_undoes_permutation(tmp_path):
  weights = tiny_hf_weights(1)
  hf, tensors, tok = read_gguf(write_tiny_gguf(tmp_path / "t.gguf", weights))
  assert tensors.keys() == weights.keys()
  for name, w in weights.items():
    np.testing.assert_array_equal(tensors[name], w, err_msg=name)
  assert hf["tie_word_embeddings"] is False
  shape_keys = ["num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                "intermediate_size", "num_hidden_layers"]
  assert [hf[k] for k in shape_keys] == [4, 2, 64, 256, 512, 2]
  assert hf["rope_theta"] == 500000.0 and hf["rms_norm_eps"] == 1e-6
  assert hf["max_position_embeddings"] == 128 and hf["vocab_size"] == len(TINY_TOKENS)
  assert hf["eos_token_id"] == 2 and hf["bos_token_id"] == 1
  assert "rope_scaling" not in hf
  assert isinstance(tok, Tokenizer)


def test_tiny_tied_embeddings(tmp_path):
  hf, tensors, _ = read_gguf(write_tiny_gguf(tmp_path / "t.gguf",
                                             tiny_hf_weights(2, untied=False)))
  assert hf["tie_word_embeddings"] is True and "lm_head.weight" not in tensors


@pytest.mark.parametrize("type_name, atol", [
    ("F16", 2e-3), ("BF16", 2e-2), ("Q8_0", 3e-2), ("Q4_1", 0.5), ("Q4_0", 0.6)])
def test_quantised_types_keep_layout(tmp_path, type_name, atol):
  weights = tiny_hf_weights(3)
  qtype = QType[type_name]
  quantised = {}
  for hf_name in ["model.layers.1.mlp.down_proj.weight",
                  "model.layers.0.self_attn.k_proj.weight"]:
    w = weights[hf_name]
    if ".k_proj." in hf_name:
      w = llama_cpp_permute(w, TINY["kv_heads"])
    quantised[gguf_name(hf_name)] = (quants.quantize(w, qtype), qtype)
  _, tensors, _ = read_gguf(write_tiny_gguf(tmp_path / "t.gguf", weights, raw=quantised))
  down = tensors["model.layers.1.mlp.down_proj.weight"]
  expected = quants.dequantize(quantised["blk.1.ffn_down.weight"][0], qtype)
  np.testing.assert_array_equal(down, expected)
  np.testing.assert_allclose(down, weights["model.layers.1.mlp.down_proj.weight"],
                             atol=atol, rtol=0)
  np.testing.assert_allclose(tensors["model.layers.0.self_attn.k_proj.weight"],
                             weights["model.layers.0.self_attn.k_proj.weight"],
                             atol=atol, rtol=0)


def _k_quant_rows(values: np.ndarray, qtype) -> np.ndarray:
  """Q4_K / Q6_K bytes whose 256-value blocks are constant: values[row, block].

  Q6_K block: ql[128], qh[64] (all 0 -> q - 32 = -32), int8 scales[16] = 1,
  f16 d = -v/32. Q4_K block: f16 d = v, f16 dmin = 0, 12 scale bytes giving every
  sub-block scale 1 and min 0, qs all 0x11 (every 4-bit q = 1).
  """
  def block(v):
    if qtype == QType.Q6_K:
      return np.concatenate([np.zeros(192, np.uint8), np.ones(16, np.uint8),
                             np.array([-v / 32], np.float16).view(np.uint8)])
    return np.concatenate([np.array([v, 0], np.float16).view(np.uint8),
                           np.array([1] * 4 + [0] * 4 + [1] * 4, np.uint8),
                           np.full(128, 0x11, np.uint8)])
  return np.stack([np.concatenate([block(v) for v in row]) for row in values])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_keep_layout(tmp_path, type_name):
  qtype = QType[type_name]
  weights = tiny_hf_weights(4)
  rows, cols = weights["model.layers.0.mlp.down_proj.weight"].shape  # [256, 512]
  blocks = np.arange(rows * (cols // 256), dtype=np.float32).reshape(rows, -1) % 50 - 20
  raw = {"blk.0.ffn_down.weight": (_k_quant_rows(blocks, qtype), qtype)}
  _, tensors, _ = read_gguf(write_tiny_gguf(tmp_path / "t.gguf", weights, raw=raw))
  np.testing.assert_array_equal(tensors["model.layers.0.mlp.down_proj.weight"],
                                np.repeat(blocks, 256, axis=1))


def test_unsupported_quant_type(tmp_path):
  weights = tiny_hf_weights(5)
  w = weights["model.layers.0.mlp.up_proj.weight"]
  raw = {"blk.0.ffn_up.weight": (quants.quantize(w, QType.Q5_0), QType.Q5_0)}
  with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*Q5_0"):
    read_gguf(write_tiny_gguf(tmp_path / "t.gguf", weights, raw=raw))


def test_non_llama_architecture(tmp_path):
  path = write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2")
  with pytest.raises(ConfigError, match="'qwen2'"):
    read_gguf(path)


def test_missing_truncated_and_foreign_files(tmp_path):
  missing = tmp_path / "none.gguf"
  with pytest.raises(CheckpointError, match="does not exist") as info:
    read_gguf(missing)
  assert str(missing) in str(info.value)
  good = write_tiny_gguf(tmp_path / "t.gguf").read_bytes()
  for cut in [200, len(good) // 2, len(good) - 100]:  # Metadata, then tensor data.
    truncated = tmp_path / f"cut{cut}.gguf"
    truncated.write_bytes(good[:cut])
    with pytest.raises(CheckpointError) as info:
      read_gguf(truncated)
    assert str(truncated) in str(info.value)
  foreign = tmp_path / "model.gguf"
  foreign.write_bytes(b"PK\x03\x04 this is a zip, not GGUF" * 10)
  with pytest.raises(CheckpointError, match="not a GGUF file") as info:
    read_gguf(foreign)
  assert str(foreign) in str(info.value)


def _llama3_rope_factors(theta, dim, factor, low, high, original):
  """llama.cpp's rope_freqs tensor for Llama-3 scaling (per frequency divisor)."""
  factors = []
  for i in range(0, dim, 2):
    wavelen = 2 * math.pi * theta ** (i / dim)
    if wavelen < original / high:
      factors.append(1.0)
    elif wavelen > original / low:
      factors.append(factor)
    else:
      smooth = (original / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(factors, np.float32)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
  freqs = _llama3_rope_factors(500000.0, TINY["head_dim"], 8.0, 1.0, 4.0, 64)
  assert 1.0 < freqs.max() and freqs.min() == 1.0  # Both regimes present.
  hf, tensors, _ = read_gguf(write_tiny_gguf(
      tmp_path / "t.gguf", extra_tensors={"rope_freqs.weight": freqs},
      extra=lambda w: w.add_uint32("llama.rope.scaling.original_context_length", 64)))
  assert hf["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}
  assert not any("rope_freqs" in name for name in tensors)


def test_unsupported_rope_scaling(tmp_path):
  path = write_tiny_gguf(tmp_path / "t.gguf", extra=lambda w: (
      w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)))
  with pytest.raises(ConfigError, match="yarn"):
    read_gguf(path)
  odd = np.linspace(1.0, 3.0, TINY["head_dim"] // 2).astype(np.float32)
  with pytest.raises(ConfigError, match="rope_freqs"):
    read_gguf(write_tiny_gguf(tmp_path / "u.gguf",
                              extra_tensors={"rope_freqs.weight": odd}))


def test_tiny_tokenizer_from_gguf(tmp_path):
  path = write_tiny_gguf(tmp_path / "t.gguf")
  tok = gguf_io.tokenizer_from_gguf(str(path))
  he, the, think = (TINY_TOKENS.index(t) for t in ("he", "Ġthe", "<think>"))
  byte = lambda c: 3 + ord(c)  # Bytes follow the 3 control tokens.
  assert tok.encode(" the he") == [the, byte(" "), he]
  assert tok.encode("<|im_start|><think>") == [1, think]  # Control + user-defined.
  assert tok.decode([1, he, think]) == "he<think>"  # Only control tokens skipped.
  assert tok.encode("x12") == [byte("x"), byte("1"), byte("2")]
  assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and not tok.add_bos
  assert tok.apply_chat_template("hi") == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  again = Tokenizer.from_dir(tok.save(tmp_path / "saved"))
  for text in ["<|im_start|>user\n the he<|im_end|>", "Ünïcode 🙂 x12 <think>"]:
    assert again.encode(text) == tok.encode(text)
  assert again.chat_template == tok.chat_template
  assert again.eos_token_ids == tok.eos_token_ids
  assert again.bos_token_id == tok.bos_token_id


def test_gguf_pre_tokenizers(tmp_path):
  ids = {t: TINY_TOKENS.index(t) for t in ("12", "123", "34", "xyz")}
  byte = lambda c: 3 + ord(c)
  smollm = gguf_io.tokenizer_from_gguf(write_tiny_gguf(tmp_path / "s.gguf"))
  # Every digit its own pre-token; no whole-word lookup for "xyz".
  assert smollm.encode("1234") == [byte(c) for c in "1234"]
  assert smollm.encode("xyz") == [byte(c) for c in "xyz"]
  llama3 = gguf_io.tokenizer_from_gguf(write_tiny_gguf(tmp_path / "l.gguf", pre="llama-bpe",
                                               add_bos=None))
  # Digits in groups of up to three, then merges; whole words looked up first.
  assert llama3.encode("1234") == [1, ids["123"], byte("4")]  # BOS 1 by default.
  assert llama3.encode("xyz") == [1, ids["xyz"]]
  gpt2 = gguf_io.tokenizer_from_gguf(write_tiny_gguf(tmp_path / "g.gguf", pre="gpt-2"))
  assert gpt2.encode("1234") == [ids["12"], ids["34"]]  # One pre-token "1234".


def test_unsupported_gguf_tokenizer(tmp_path):
  with pytest.raises(ConfigError, match="'llama'"):
    read_gguf(write_tiny_gguf(tmp_path / "t.gguf", tokenizer_model="llama"))


# ------------------------------------------------------ the embedded SmolLM2


@pytest.fixture(scope="module")
def smollm2():
  """(hf_config, tensors, tokenizer) of the embedded GGUF, read once."""
  return read_gguf(embedded_gguf_path())


def test_smollm2_config(smollm2):
  hf, _, tok = smollm2
  # Facts about SmolLM2-135M-Instruct (model card / design notes).
  expected = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
              "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
              "head_dim": 64, "tie_word_embeddings": True, "rope_theta": 100000.0,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
              "bos_token_id": 1, "eos_token_id": 2}
  assert {k: hf[k] for k in expected} == expected
  assert tok.eos_token_ids == (2,) and tok.vocab_size == 49152


def test_smollm2_tensors(smollm2):
  _, tensors, _ = smollm2
  assert len(tensors) == 30 * 9 + 2 and "lm_head.weight" not in tensors
  assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
  assert tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
  assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
  assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in tensors.values())


# Made by transformers 5.24's GGUF loader (load_gguf_checkpoint with a Llama
# model, which dequantises and un-permutes q/k itself), float32:
#   sd = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
#   w[:3, :4] and w[64:72].sum(1) (rows 0-7 of head 1)
TRANSFORMERS_VALUES = {
    "model.layers.0.self_attn.q_proj.weight": (
        [[-0.0963134765625, 0.1573486328125, -0.0963134765625, -0.73046875],
         [-0.1591796875, 0.39794921875, -0.0198974609375, -1.2734375],
         [-0.109375, 0.1015625, -0.3203125, -0.3203125]],
        [-6.8153076171875, 1.43072509765625, -13.59478759765625, 0.9251708984375,
         1.478485107421875, -6.59014892578125, 2.96087646484375, 12.95135498046875]),
    "model.layers.0.self_attn.k_proj.weight": (
        [[-0.1552734375, 0.3402099609375, -0.485595703125, -0.3204345703125],
         [0.203369140625, 0.09136962890625, 0.203369140625, -0.13262939453125],
         [-0.126953125, 0.291748046875, -0.043212890625, 0.124267578125]],
        [-3.66094970703125, -8.52655029296875, 11.0211181640625, -8.63470458984375,
         -15.92584228515625, 2.19671630859375, -3.7320556640625, -0.64007568359375]),
    "model.layers.29.self_attn.k_proj.weight": (
        [[0.062408447265625, 0.00433349609375, 0.0333709716796875, 0.01885223388671875],
         [0.05859375, -0.02734375, 0.1015625, -0.11328125],
         [-0.0477294921875, -0.0087890625, 0.0301513671875, -0.1256103515625]],
        [0.11737060546875, -2.16522216796875, -6.60455322265625, -1.729644775390625,
         0.5711517333984375, 3.1036529541015625, 1.94964599609375, 3.4017486572265625]),
}


def test_smollm2_weights_match_transformers(smollm2):
  _, tensors, _ = smollm2
  for name, (corner, row_sums) in TRANSFORMERS_VALUES.items():
    w = tensors[name]
    np.testing.assert_allclose(w[:3, :4], corner, rtol=0, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(w[64:72].sum(1), row_sums, rtol=0, atol=1e-4, err_msg=name)
  np.testing.assert_allclose(tensors["model.embed_tokens.weight"][1, :4],
                             [-0.0238037109375, -0.015869140625, -0.0396728515625,
                              0.015869140625], rtol=0, atol=1e-7)


def test_smollm2_chat_ids_match_transformers(smollm2):
  if not FIXTURE.exists():
    pytest.skip(f"fixture {FIXTURE} not present")
  _, _, tok = smollm2
  prompts = json.loads(FIXTURE.read_text())["prompts"]
  assert prompts
  for prompt in prompts:
    assert tok.apply_chat_template(prompt["messages"]) == prompt["prompt_text"]
    assert tok.encode_chat(prompt["messages"]) == prompt["prompt_ids"]


def test_smollm2_tokenizer_text(smollm2):
  _, _, tok = smollm2
  # SmolLM2 was trained with every digit its own pre-token.
  ids = tok.encode("in 2024, x=12")
  digits = [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()]
  assert digits == ["2", "0", "2", "4", "1", "2"]
  assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
  text = "Grüße aus Köln! 東京 🙂🚀 naïve café\n\tdone"
  assert tok.decode(tok.encode(text)) == text
  stream = tok.stream_decoder()
  chunks = [stream.feed(i) for i in tok.encode(text)]
  assert "".join(chunks) + stream.flush() == text and "" in chunks


def test_smollm2_converted_dir_is_identical(smollm2, tmp_path):
  hf, all_tensors, tok = smollm2
  # A few tensors keep the test fast (the full 540 MB write is the same code);
  # the tokenizer and config are the real, complete ones.
  names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.norm.weight"]
  tensors = {n: all_tensors[n] for n in names}
  directory = default_model.write_converted_dir(tmp_path / "smollm2", hf, tensors, tok)
  hf2, tensors2 = read_safetensors_dir(directory)
  tok2 = Tokenizer.from_dir(directory)
  assert hf2 == hf
  assert tensors2.keys() == tensors.keys()
  for name in tensors:
    np.testing.assert_array_equal(tensors2[name], tensors[name], err_msg=name)
  assert (tok2.eos_token_ids, tok2.bos_token_id, tok2.add_bos, tok2.vocab_size) == (
      tok.eos_token_ids, tok.bos_token_id, tok.add_bos, tok.vocab_size)
  assert tok2.chat_template == tok.chat_template
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Sum 17 and 25, then say 🙂."}]
  assert tok2.encode_chat(messages) == tok.encode_chat(messages)
