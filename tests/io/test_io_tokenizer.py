"""Tokenizer: HF directories, chat templates, BOS / EOS, streaming decode."""

import json

import pytest
from tokenizers import AddedToken, Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors

from dart_jax.errors import CheckpointError, ConfigError, InputError
from dart_jax.io import Tokenizer
from dart_jax.io.chat_template import render_chat_template

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
          "assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
  """The 256 characters GPT-2 style byte-level BPE uses for the bytes 0..255."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


def byte_ids(text: str) -> list[int]:
  """Ids of text encoded byte by byte (valid where no merge applies)."""
  return [4 + b for b in text.encode("utf-8")]


def make_backend(post_bos: bool = False) -> Backend:
  """Byte-level BPE: specials 0-3, bytes 4-259, merges for ' the' and 'he'."""
  tokens = SPECIALS + byte_alphabet() + ["he", "Ġt", "Ġthe"]
  merges = [("h", "e"), ("Ġ", "t"), ("Ġt", "he")]
  backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t in SPECIALS])
  if post_bos:
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 3)])
  return backend


def write_dir(directory, tok_config=None, gen_config=None, post_bos=False):
  directory.mkdir(exist_ok=True)
  make_backend(post_bos).save(str(directory / "tokenizer.json"))
  if tok_config is not None:
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
  if gen_config is not None:
    (directory / "generation_config.json").write_text(json.dumps(gen_config))
  return directory


def test_encode_decode_and_special_tokens(tmp_path):
  tok = Tokenizer.from_dir(write_dir(tmp_path / "t", {"eos_token": "<|im_end|>"}))
  # Byte b has id 4 + b; "he" (260) and " the" (262) are merged tokens.
  assert tok.encode("the hat") == [4 + ord("t"), 260, *byte_ids(" hat")]
  assert tok.encode(" the") == [262]
  assert tok.encode("he") == [260]
  # Special-token text becomes one id; skip_special_tokens drops it on decode.
  assert tok.encode("<|im_start|>he") == [1, 260]
  assert tok.decode([1, 260]) == "he"
  assert tok.decode([1, 260], skip_special_tokens=False) == "<|im_start|>he"
  text = "Grüße, 世界 🙂 the end"
  assert tok.decode(tok.encode(text)) == text
  assert tok.eos_token_ids == (2,)
  assert tok.vocab_size == 263
  assert not tok.add_bos


def test_eos_from_tokenizer_config_and_generation_config(tmp_path):
  directory = write_dir(tmp_path / "t", {"eos_token": {"content": "<|im_end|>"},
                                         "bos_token": "<s>"},
                        {"eos_token_id": [0, 2]})
  tok = Tokenizer.from_dir(directory)
  assert tok.eos_token_ids == (2, 0)
  assert tok.bos_token_id == 3 and tok.bos_token == "<s>"


def test_add_bos_from_flag_and_from_post_processor(tmp_path):
  flagged = Tokenizer.from_dir(write_dir(
      tmp_path / "a", {"bos_token": "<s>", "add_bos_token": True}))
  assert flagged.encode(" the") == [3, 262]
  inferred = Tokenizer.from_dir(write_dir(tmp_path / "b", {"bos_token": "<s>"},
                                          post_bos=True))
  assert inferred.add_bos and inferred.encode(" the") == [3, 262]
  off = Tokenizer.from_dir(write_dir(
      tmp_path / "c", {"bos_token": "<s>", "add_bos_token": False}, post_bos=True))
  assert off.encode(" the") == [262]


def test_chat_template_from_config_file_and_named_list(tmp_path):
  tok = Tokenizer.from_dir(write_dir(tmp_path / "a", {"chat_template": CHATML}))
  expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert tok.apply_chat_template("hi") == expected
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                 add_generation_prompt=False) == expected[:-len(
                                     "<|im_start|>assistant\n")]
  named = Tokenizer.from_dir(write_dir(tmp_path / "b", {"chat_template": [
      {"name": "tool_use", "template": "TOOLS"},
      {"name": "default", "template": CHATML}]}))
  assert named.apply_chat_template("hi") == expected
  directory = write_dir(tmp_path / "c", {})
  (directory / "chat_template.jinja").write_text(CHATML)
  assert Tokenizer.from_dir(directory).apply_chat_template("hi") == expected


def test_encode_chat_ids_and_no_extra_bos(tmp_path):
  tok = Tokenizer.from_dir(write_dir(
      tmp_path / "t", {"chat_template": "{{ bos_token }}" + CHATML, "bos_token": "<s>",
                       "add_bos_token": True, "eos_token": "<|im_end|>"}))
  ids = tok.encode_chat([{"role": "user", "content": "he"}])
  # BOS once (written by the template), never prepended a second time.
  assert ids == [3, 1, *byte_ids("user\n"), 260, 2, *byte_ids("\n"), 1,
                 *byte_ids("assistant\n")]
  assert tok.encode("he") == [3, 260]  # Plain encode does add BOS here.


def test_template_environment_matches_hf():
  # trim_blocks / lstrip_blocks: block tags leave no newline or indentation.
  template = "  {% if true %}\nA{{ x | tojson }}\n  {% endif %}\nB"
  assert render_chat_template(template, "u", x={"k": "é"}) == 'A{"k": "é"}\nB'
  with pytest.raises(InputError, match="roles must alternate"):
    render_chat_template("{{ raise_exception('roles must alternate') }}", "u")
  loop = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
          "{{ m.content }}{% endfor %}")
  assert render_chat_template(loop, [{"role": "user", "content": "a"},
                                     {"role": "user", "content": "b"}]) == "a"
  assert render_chat_template("[{{ bos_token }}|{{ eos_token }}]", "u",
                              bos_token="<s>", eos_token="</s>") == "[<s>|</s>]"


def test_chat_bad_inputs(tmp_path):
  tok = Tokenizer.from_dir(write_dir(tmp_path / "t", {"chat_template": CHATML}))
  with pytest.raises(InputError, match="empty"):
    tok.encode_chat([])
  with pytest.raises(InputError, match="role"):
    tok.encode_chat([{"content": "no role"}])
  with pytest.raises(InputError, match="string or a list"):
    tok.encode_chat({"role": "user", "content": "a dict, not a list"})
  plain = Tokenizer.from_dir(write_dir(tmp_path / "p", {}))
  with pytest.raises(ConfigError, match="no chat template"):
    plain.encode_chat("hi")
  broken = Tokenizer(make_backend(), chat_template="{% for m in messages %}")
  with pytest.raises(ConfigError, match="not valid jinja2"):
    broken.apply_chat_template("hi")


def test_from_dir_bad_inputs(tmp_path):
  with pytest.raises(CheckpointError, match="tokenizer not found") as info:
    Tokenizer.from_dir(tmp_path / "nothing")
  assert str(tmp_path / "nothing" / "tokenizer.json") in str(info.value)
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "tokenizer.json").write_text("{broken")
  with pytest.raises(CheckpointError, match="cannot read tokenizer"):
    Tokenizer.from_dir(tmp_path / "bad")
  directory = write_dir(tmp_path / "cfg")
  (directory / "tokenizer_config.json").write_text("{broken")
  with pytest.raises(CheckpointError, match="tokenizer_config.json"):
    Tokenizer.from_dir(directory)


def test_save_round_trip(tmp_path):
  tok = Tokenizer(make_backend(), chat_template=CHATML, bos_token_id=3,
                  eos_token_ids=[2, 0], add_bos=True)
  again = Tokenizer.from_dir(tok.save(tmp_path / "saved"))
  assert again.eos_token_ids == (2, 0)
  assert again.bos_token_id == 3 and again.add_bos
  assert again.chat_template == CHATML
  for text in ["the he", "<|im_start|>x", "üñí 🙂"]:
    assert again.encode(text) == tok.encode(text)


def test_stream_decoder_holds_back_partial_characters():
  tok = Tokenizer(make_backend())
  text = "a 🙂 é 世 the"
  ids = tok.encode(text)
  assert len(ids) > len(text)  # Multi-byte characters span several tokens.
  stream = tok.stream_decoder()
  chunks = [stream.feed(i) for i in ids]
  assert "".join(chunks) + stream.flush() == text
  assert all("\ufffd" not in c for c in chunks)
  assert "" in chunks  # Some ids only completed part of a character.
  # Several ids at a time give the same text.
  stream = tok.stream_decoder()
  assert "".join(stream.feed(ids[i:i + 3]) for i in range(0, len(ids), 3)) == text


def test_stream_decoder_flush_and_specials():
  tok = Tokenizer(make_backend())
  emoji = tok.encode("🙂")
  stream = tok.stream_decoder()
  assert stream.feed([1] + emoji[:2]) == ""  # Special skipped; emoji incomplete.
  assert stream.flush() == "\ufffd"  # Incomplete bytes come out replaced.
  keep = tok.stream_decoder(skip_special_tokens=False)
  assert keep.feed(1) == "<|im_start|>"
