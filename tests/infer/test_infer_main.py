"""The generate CLI (python -m infer.main)."""

import re

import pytest

import dart_jax as dj
from infer import main as cli
from tests.helpers import FIXTURES

TINY = str(FIXTURES / "tiny_llama")


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
  for flag in ("--model", "--draft", "--ngram", "--temperature", "--top-p", "--top-k",
               "--method", "--dflash", "--domino", "--drafter", "--dartree-budget", "--mesh"):
    assert flag in text


def _humaneval_prompt():
  """test_bench's DARTree CLI prompt: the same ids, so compiled rounds are shared."""
  from infer import datasets
  (message,) = datasets.humaneval_messages(datasets.load_humaneval(1)[0])
  return message["content"]


# DARTree with a tiny random drafter on the tiny target (6 new tokens).
RANDOM_DARTREE = ["--model", TINY, "--max-new-tokens", "6", "--method", "dartree",
                  "--drafter", "random", "--drafter-block-size", "3", "--dartree-topk",
                  "2", "--dartree-width", "2", "--dartree-budget", "3"]


def test_cli_dartree_method_streams_the_ar_text(capsys):
  prompt = _humaneval_prompt()
  assert cli.main(["--prompt", prompt, *RANDOM_DARTREE, "--stats"]) == 0
  out = capsys.readouterr()
  want = dj.generate(dj.load_target(TINY), prompt, max_new_tokens=6).text
  assert out.out == want + "\n"
  assert "[dartree: " in out.err and "tokens/round" in out.err


def test_cli_compare_reports_both_methods_and_the_speedup(capsys, monkeypatch):
  calls, generate = [], dj.generate

  def counted(*args, **kwargs):
    calls.append("spec" if {"method", "draft"} & set(kwargs) else "ar")
    return generate(*args, **kwargs)

  monkeypatch.setattr(dj, "generate", counted)
  assert cli.main(["--prompt", _humaneval_prompt(), *RANDOM_DARTREE, "--compare"]) == 0
  # Plain decoding compiled (the first call streams), then 3 warm runs each, alternating.
  assert calls == ["ar", "ar", "spec", "spec", "ar", "ar", "spec"], calls
  err = capsys.readouterr().err.splitlines()
  assert err[-2].startswith("[dartree: 6 tokens")
  assert re.fullmatch(r"\[warm, median of 3 alternating runs: dartree \d+\.\d tok/s "
                      r"\(\d\.\d\d tokens/round\), ar \d+\.\d tok/s: \d+\.\d\dx\]",
                      err[-1]), err[-1]


@pytest.mark.parametrize("argv, message", [
    (["--method", "dartree", "--model", "m"], "needs a Domino drafter"),
    (["--method", "ddtree", "--model", "m"], "needs a drafter for --model m: --dflash DIR"),
    (["--dflash", "d", "--method", "dartree", "--model", "m"],
     "gives only the DFlash backbone"),
    (["--draft", "h", "--method", "dartree", "--drafter", "random"],
     "--draft are DART options"),
    (["--draft", "h", "--domino", "d"], "--domino are DARTree options"),
    (["--method", "dart", "--model", "some_dir"], "needs --draft"),
    (["--dartree-budget", "4"], "--dartree-budget: only for speculative decoding"),
    (["--drafter", "random", "--dartree-depth-bonus", "1"], "depth_bonus must be <= 0"),
    (["--method", "dart-gru-fixed"], "needs --dart-gru DIR"),
    (["--dart-gru", "g", "--domino", "d"], "--domino: DARTree drafters"),
    (["--dart-gru", "g", "--method", "dartree"], "--dart-gru is for the DART-GRU methods"),
    (["--draft", "h", "--dart-gru", "g"], "--dart-gru are DARTree options"),
])
def test_cli_rejects_bad_method_options(argv, message, capsys):
  # Caught before the (default, embedded) target loads.
  assert cli.main(["--prompt", "Hi", *argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and message in err, err


def test_cli_unknown_method_lists_the_valid_ones(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--prompt", "Hi", "--method", "beam"])
  err = capsys.readouterr().err
  assert "invalid choice: 'beam'" in err
  for name in ("ar", "dart", "dflash-chain", "domino-chain", "ddtree", "dartree-fixed",
               "dartree"):
    assert f"'{name}'" in err


def test_cli_mesh_runs_on_a_one_device_mesh_and_rejects_a_larger_one(capsys):
  import jax

  assert cli.main(["--prompt", "Hello there", "--model", TINY, "--max-new-tokens", "8",
                   "--mesh", "data=1,tensor=1"]) == 0
  want = dj.generate(dj.load_target(TINY), "Hello there", max_new_tokens=8).text
  assert capsys.readouterr().out == want + "\n"
  too_many = jax.device_count() + 1
  assert cli.main(["--prompt", "Hi", "--model", TINY, "--mesh", f"tensor={too_many}"]) == 2
  err = capsys.readouterr().err
  assert f"needs {too_many} devices" in err, err
