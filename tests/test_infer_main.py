"""The generate CLI (python -m infer.main)."""

import pathlib

import pytest

import dart_jax as dj
from infer import main as cli

TINY = str(pathlib.Path(__file__).parent / "fixtures" / "tiny_llama")


def test_cli_streams_the_same_text_as_generate(capsys):
  assert cli.main(["--prompt", "Hello there", "--model", TINY, "--max-new-tokens", "8",
                   "--stats"]) == 0
  out = capsys.readouterr()
  want = dj.generate(dj.load_target(TINY), "Hello there", max_new_tokens=8).text
  assert out.out == want + "\n"
  assert "tok/s" in out.err


def test_cli_errors_are_clear(capsys, tmp_path):
  assert cli.main(["--prompt", "Hi", "--model", str(tmp_path / "missing")]) == 2
  assert "missing" in capsys.readouterr().err
  assert cli.main(["--prompt", "Hi", "--model", TINY, "--ngram", "x.trie"]) == 2
  assert "--draft" in capsys.readouterr().err


def test_cli_help_documents_options(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  text = capsys.readouterr().out
  for flag in ("--model", "--draft", "--ngram", "--temperature", "--top-p", "--top-k"):
    assert flag in text
