"""Which decoder runs a drafter: the one place that maps a draft model to its method.

``generate(target, prompt, draft=...)`` calls ``make_decoder``; the draft models
(``dart_jax.draft``) hold weights only and import nothing from decoding, so the
imports run one way: draft models <- decoders <- this table <- ``generate``.

| ``draft``         | proposer (in ``SpeculativeDecoder``) | ``tree=``                          |
|-------------------|------------------------------|-------------------------------------------|
| None              | ``ARDecoder`` (plain)        | -                                         |
| ``DartHead``      | ``DartProposer`` (DART)      | a ``TreeConfig`` (default: the head's)    |
| ``DFlashDrafter`` | ``DARTreeProposer``          | "dartree" (default), "dartree-fixed", "ddtree", "chain" |
| ``DartGruDrafter``| ``DartGruProposer``          | as DFlash (DART's drafting, DARTree's trees) |
"""

from dart_jax.decode.ar import ARDecoder, Decoder
from dart_jax.decode.dart import dart_decoder, dart_gru_decoder
from dart_jax.decode.dartree import dartree_decoder, tree_options
from dart_jax.draft.dart_gru import DartGruDrafter
from dart_jax.draft.dart_head import DartHead
from dart_jax.draft.dflash import DFlashDrafter
from dart_jax.errors import InputError
from dart_jax.models.target import Target
from dart_jax.sampling import SamplingConfig
from dart_jax.tree.dartree import DARTreeConfig


def _dart(target, head: DartHead, *, sampling, seed=0, ngram=None, tree=None, **kwargs):
  return dart_decoder(target, head, sampling=sampling, seed=seed, ngram=ngram, tree=tree,
                      **kwargs)


def _tree_method(name: str, has_correction, make):
  """A DARTree-style factory: ``tree=`` / ``tree_config=`` / fields -> ``make``."""

  def factory(target, drafter, *, sampling, seed=0, ngram=None, tree="dartree",
              tree_config: DARTreeConfig | None = None, profile: bool = False,
              **overrides):
    if ngram is not None:
      raise InputError(f"{name} methods use no N-gram model; drop ngram=...")
    method, tree_config = tree_options(tree, tree_config, overrides,
                                       has_correction(drafter))
    return make(target, drafter, method, tree_config, sampling=sampling, seed=seed,
                profile=profile)

  return factory


_dartree = _tree_method("DARTree", lambda drafter: drafter.domino, dartree_decoder)
_dart_gru = _tree_method("DART-GRU", lambda drafter: True, dart_gru_decoder)


# Checked in order: the first class the drafter is an instance of decides.
DECODERS = ((DartHead, _dart), (DFlashDrafter, _dartree), (DartGruDrafter, _dart_gru))


def make_decoder(target: Target, sampling: SamplingConfig, seed: int, draft=None,
                 ngram=None, **method_kwargs) -> Decoder:
  """The decoder for a method: AR when ``draft`` is None, else the drafter's
  (``DECODERS``); ``method_kwargs`` go to it (``tree=``, ``context_ngram=``,
  ``profile=``, DARTree tree fields)."""
  if draft is None:
    if ngram is not None or method_kwargs:
      raise InputError("ngram / tree options need a draft head (draft=...)")
    return ARDecoder(target, sampling, seed)
  for kind, make in DECODERS:
    if isinstance(draft, kind):
      return make(target, draft, sampling=sampling, seed=seed, ngram=ngram,
                  **method_kwargs)
  raise InputError(f"draft={type(draft).__name__} is not a supported draft model; pass "
                   "a DartHead (dj.load_dart), a DFlashDrafter (dj.load_dflash / "
                   "dj.load_domino) or a DartGruDrafter (dj.load_dart_gru)")
