"""Typed methods (``generate(method=...)``) and the method registry."""

import numpy as np
import pytest

import dart_jax as dj
from dart_jax.decode import methods
from dart_jax.models import Target
from dart_jax.ngram import NGram
from dart_jax.tree import DARTreeConfig, TreeConfig
from tests.helpers import TARGETS

TREE = TreeConfig(remain_total=6, topk=3, beam_width=3)
DARTREE = DARTreeConfig(topk=4, supertree_width=3, budget=6)
PROMPTS = [[5, 17, 3, 44], [9, 2]]


@pytest.fixture(scope="module")
def tiny():
  target = Target.init(TARGETS["llama"], seed=2)
  head = dj.DartHead.init(target, draft_length=3, seed=4)
  domino = dj.DFlashDrafter.init(target, block_size=4, num_layers=1, domino=True, seed=4)
  dart_gru = dj.DartGruDrafter.from_head(head, emb_dim=16, gru_hidden_dim=24, seed=5)
  ngram = NGram.build([p * 3 for p in PROMPTS], order=3)
  return target, head, domino, dart_gru, ngram


def _decode(target, **kwargs):
  out = dj.generate(target, PROMPTS, max_new_tokens=12, eos_token_ids=(), **kwargs)
  return out.tokens, out.stats.rounds


def test_typed_methods_decode_as_the_draft_call_does(tiny):
  """method=DART/DARTree/DartGru takes the same rounds as the draft= call with
  the same options (and both equal plain decoding: they are lossless)."""
  target, head, domino, dart_gru, ngram = tiny
  ar, _ = _decode(target)
  pairs = [
      (dict(method=dj.DART(head, ngram, tree=TREE, context_ngram=False)),
       dict(draft=head, ngram=ngram, tree=TREE, context_ngram=False)),
      (dict(method=dj.DARTree(domino, "dartree-fixed", DARTREE)),
       dict(draft=domino, tree="dartree-fixed", tree_config=DARTREE)),
      (dict(method=dj.DartGru(dart_gru, "chain")), dict(draft=dart_gru, tree="chain")),
  ]
  for typed, old in pairs:
    assert _decode(target, **typed) == _decode(target, **old)
    assert _decode(target, **typed)[0] == ar


def test_method_for_maps_the_draft_call_to_the_typed_method(tiny):
  target, head, domino, dart_gru, ngram = tiny
  dart = methods.method_for(head, ngram, tree=TREE)
  assert isinstance(dart, dj.DART) and dart.tree is TREE and dart.ngram is ngram
  tree_method = methods.method_for(domino, tree="ddtree", budget=5)
  assert isinstance(tree_method, dj.DARTree)
  assert (tree_method.tree, tree_method.config) == ("ddtree", DARTreeConfig(budget=5))
  assert methods.method_for(dart_gru, tree="chain").tree == "domino-chain"


def test_bad_methods_are_clear_errors(tiny):
  target, head, domino, dart_gru, ngram = tiny
  with pytest.raises(dj.InputError, match="either method"):
    dj.generate(target, PROMPTS, method=dj.DART(head), draft=head)
  with pytest.raises(dj.InputError, match="needs a DartHead"):
    dj.DART(domino)
  with pytest.raises(dj.InputError, match="needs a DFlashDrafter"):
    dj.DARTree(head)
  with pytest.raises(dj.InputError, match="TreeConfig"):
    dj.DART(head, tree="dartree")
  with pytest.raises(dj.InputError, match="method must be"):
    dj.generate(target, PROMPTS, method="dart")
  with pytest.raises(dj.InputError, match="unknown DART option"):
    dj.generate(target, PROMPTS, draft=head, budget=4)
  with pytest.raises(dj.InputError, match="no N-gram"):
    dj.generate(target, PROMPTS, draft=domino, ngram=ngram)
  with pytest.raises(dj.ConfigError, match="unknown DARTree method"):
    dj.generate(target, PROMPTS, method=dj.DARTree(domino, "beam"))


def test_registry_is_consistent():
  names = methods.method_names()
  assert len(names) == len(set(names)) and names[0] == "ar"
  assert methods.method_names(family="dartree") == (
      "dflash-chain", "domino-chain", "ddtree", "dartree-fixed", "dartree")
  assert set(methods.method_names(lossless=True)) == set(names) - {"ar", "hf"}
  for info in methods.METHODS.values():
    if info.family in ("dartree", "dart_gru"):
      assert info.tree is not None
      # Every tree name is one the DARTree tree builder accepts.
      dj.tree.dartree.resolve_method(info.tree, info.drafter != "dflash")
    assert (info.drafter is None) == (info.family in ("ar", "hf"))
  np.testing.assert_array_equal(sorted(methods.DRAFTER_KINDS),
                                ["dart", "dart_gru", "dflash", "domino"])


def test_every_drafter_kind_has_one_training_objective():
  from train import objectives

  assert set(objectives.OBJECTIVES) == set(methods.DRAFTER_KINDS)
  for kind, objective in objectives.OBJECTIVES.items():
    assert objectives.for_config_type(objective.CONFIG_TYPE) is objective, kind
