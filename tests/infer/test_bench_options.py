"""The benchmark's options, method names and drafter loading (infer.bench_options)."""

import dataclasses
import re

import numpy as np
import pytest

import dart_jax as dj
from dart_jax.tree.dartree import CORRECTED_METHODS, TREE_METHODS
from infer import bench, bench_options
from tests.infer import bench_helpers
from tests.draft.test_dflash import released_dir


@pytest.fixture(scope="module")
def tiny():
  return bench_helpers.tiny()


def test_dartree_method_names_are_generates_tree_names():
  assert set(bench_options.DARTREE_METHODS) == set(TREE_METHODS)
  assert set(bench_options.DOMINO_METHODS) == set(CORRECTED_METHODS)
  assert set(bench_options.LOSSLESS_METHODS) == (
      {"dart", "dart-no-context"} | set(TREE_METHODS)
      | {"dart-gru", "dart-gru-fixed", "dart-gru-chain"})
  assert set(bench_options.METHODS) == {"ar", "hf"} | set(bench_options.LOSSLESS_METHODS)
  assert set(bench_options.DART_GRU_TREES.values()) <= set(TREE_METHODS) | {"chain"}


def test_cli_rejects_bad_arguments(capsys):
  assert bench.main(["--method", "ar,foo"]) == 2
  assert "unknown --method" in capsys.readouterr().err
  assert bench.main(["--dataset", "gsm8k"]) == 2
  assert "unknown --dataset" in capsys.readouterr().err
  assert bench.main(["--method", "ar,hf", "--profile"]) == 2
  assert "--profile times the phases of speculative methods" in capsys.readouterr().err


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
  """Released-format drafter directories (numpy-written, test_dflash's layout):
  plain DFlash and Domino for tiny_llama, and a Domino drafter made for another
  target (hidden 32, vocab 97, 4 layers)."""
  root = tmp_path_factory.mktemp("drafters")
  rng = np.random.default_rng(0)
  tiny_llama = dict(hidden=64, heads=4, kv=2, hd=16, inter=64, layers=1, vocab=320,
                    block=3, ids=(1,), num_target=3, emb=8, gru=8, mask=319)
  released_dir(root / "dflash", rng, domino=False, **tiny_llama)
  released_dir(root / "domino", rng, domino=True, **tiny_llama)
  released_dir(root / "other", rng, domino=True)
  return {name: str(root / name) for name in ("dflash", "domino", "other")}


def _args(*argv):
  return bench_options.build_parser().parse_args(list(argv))


def test_drafters_serve_their_methods(tiny, drafter_dirs):
  target, _ = tiny
  dflash, domino = drafter_dirs["dflash"], drafter_dirs["domino"]
  everything = ["ar", "dart", *bench_options.DARTREE_METHODS]
  # Only --domino: its backbone also serves the DFlash methods.
  chosen = bench_options.load_drafters(_args("--domino", domino), target, everything)
  assert set(chosen) == set(bench_options.DARTREE_METHODS)
  assert {source for _, source in chosen.values()} == {domino}
  assert all(d.domino for d, _ in chosen.values())
  assert len({id(d) for d, _ in chosen.values()}) == 1  # loaded once
  # Both: the DFlash drafter serves dflash-chain and ddtree.
  chosen = bench_options.load_drafters(_args("--dflash", dflash, "--domino", domino),
                                       target, everything)
  assert {m: (d.domino, s) for m, (d, s) in chosen.items()} == {
      "dflash-chain": (False, dflash), "ddtree": (False, dflash),
      "domino-chain": (True, domino), "dartree-fixed": (True, domino),
      "dartree": (True, domino)}
  # Only --dflash, only DFlash methods.
  chosen = bench_options.load_drafters(_args("--dflash", dflash), target, ["ar", "ddtree"])
  assert list(chosen) == ["ddtree"] and not chosen["ddtree"][0].domino
  # No DARTree method: nothing is loaded, even from a bad path.
  assert bench_options.load_drafters(_args("--domino", "/nonexistent"), target, ["ar"]) == {}
  # A random drafter: one Domino drafter of the requested size for all methods.
  chosen = bench_options.load_drafters(
      _args("--drafter", "random", "--drafter-block-size", "5", "--drafter-layers", "2"),
      target, everything)
  (drafter,) = {id(d): d for d, _ in chosen.values()}.values()
  assert drafter.domino and drafter.config.block_size == 5
  assert drafter.config.num_layers == 2


def test_drafter_for_another_target_is_rejected(tiny, drafter_dirs):
  target, _ = tiny
  with pytest.raises(dj.ConfigError, match="does not fit this target") as e:
    bench_options.load_drafters(_args("--domino", drafter_dirs["other"]), target, ["dartree"])
  assert "hidden size 32 vs target 64" in str(e.value)
  assert "vocab 97 vs target 320" in str(e.value)
  with pytest.raises(dj.ConfigError, match="not 'domino'"):
    bench_options.load_drafters(_args("--domino", drafter_dirs["dflash"]), target, ["dartree"])
  with pytest.raises(dj.CheckpointError, match="nonexistent"):
    bench_options.load_drafters(_args("--dflash", "/nonexistent"), target, ["ddtree"])


@pytest.mark.parametrize("argv, message", [
    (["--method", "ar,beam"], "choose from ar, dart, dart-no-context, dflash-chain, domino-chain, ddtree, "
                              "dartree-fixed, dartree, dart-gru, dart-gru-fixed, "
                              "dart-gru-chain, hf"),
    # Another target than the embedded one: the shipped drafter does not serve.
    (["--method", "ar,dartree", "--model", "m"], "dartree needs a Domino drafter .* for "
                                                 "--model m"),
    (["--method", "ddtree,dflash-chain", "--model", "m"],
     "ddtree,dflash-chain needs a drafter for --model m: --dflash"),
    (["--method", "ddtree,dartree-fixed", "--dflash", "d", "--model", "m"],
     "dartree-fixed needs a Domino drafter .* --dflash d gives only the DFlash backbone"),
    (["--method", "dartree", "--drafter", "some/dir"], "--drafter takes only 'random'"),
    (["--method", "dartree", "--drafter", "random", "--domino", "d"], "replaces"),
    (["--method", "dartree", "--drafter", "random", "--drafter-block-size", "1"],
     "block-size must be >= 2"),
    (["--method", "dartree", "--drafter", "random", "--dartree-depth-bonus", "0.5"],
     "depth_bonus must be <= 0"),
    (["--method", "dartree", "--drafter", "random", "--dartree-budget", "0"],
     "--dartree-budget must be an integer >= 1 or 'auto', got '0'"),
    (["--method", "dartree", "--drafter", "random", "--dartree-budget", "1.5"],
     "--dartree-budget must be an integer >= 1 or 'auto', got '1.5'"),
    (["--method", "ddtree", "--drafter", "random", "--dartree-budget", "Auto"],
     "--dartree-budget must be an integer >= 1 or 'auto', got 'Auto'"),
    (["--method", "ar", "--dartree-budget", "-3"],
     "--dartree-budget must be an integer >= 1 or 'auto', got '-3'"),
])
def test_cli_rejects_bad_dartree_arguments(argv, message, capsys):
  # All caught before the target loads (the default model would take seconds).
  assert bench.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and re.search(message, err), err


def test_dartree_budget_auto_is_for_the_bench_only(capsys):
  from infer import main as cli
  assert cli.main(["--prompt", "Hi", "--method", "dartree", "--drafter", "random",
                   "--dartree-budget", "auto"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --dartree-budget auto is measured by python -m infer.bench")


def test_the_embedded_target_gets_the_shipped_drafter(smollm2):
  # No drafter flag and no --model: the shipped Domino drafter serves all five
  # methods, loaded once, with its measured tree; the flags change that tree.
  chosen = bench_options.load_drafters(_args(), smollm2, ["ar", *bench_options.DARTREE_METHODS])
  assert set(chosen) == set(bench_options.DARTREE_METHODS)
  assert {source for _, source in chosen.values()} == {bench_options.SHIPPED_DRAFTER}
  (drafter,) = {id(d): d for d, _ in chosen.values()}.values()
  assert drafter.domino and drafter.tree_config == dj.tree.DARTreeConfig(
      **dj.io.embedded_dartree_config())
  changed = bench_options.dartree_config(_args("--dartree-budget", "5"),
                                         base=drafter.tree_config)
  assert changed == dataclasses.replace(drafter.tree_config, budget=5)
