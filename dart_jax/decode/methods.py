"""Decoding methods: the typed method objects and the one registry of method names.

Typed methods (what ``generate(target, prompt, method=...)`` takes):

| method                               | drafter (loader)                 | tree                          |
|--------------------------------------|----------------------------------|-------------------------------|
| None                                 | - (plain decoding)               | -                             |
| ``DART(head, ngram, tree=...)``      | ``DartHead`` (``load_dart``)     | a ``TreeConfig`` (default: the head's) |
| ``DARTree(drafter, "dartree", cfg)`` | ``DFlashDrafter`` (``load_dflash`` / ``load_domino``) | a DARTree tree name + ``DARTreeConfig`` |
| ``DartGru(drafter, "dartree", cfg)`` | ``DartGruDrafter`` (``load_dart_gru``) | as DARTree             |

The older call ``generate(target, prompt, draft=head, ngram=ngram, tree=...)``
still works: ``method_for`` turns ``draft=`` and its options into the typed
method (``DECODERS`` maps the drafter's class to it).

Named methods (``METHODS``): the names ``infer.main --method``, ``infer.bench
--method``, the tree budget search and the trainer's drafter kinds read. Adding
a method is one proposer module (``dart_jax.decode.round.Proposer``, e.g.
``decode/dart.py``) plus, here, a typed method whose ``decoder`` builds a
``SpeculativeDecoder`` around it and one ``MethodInfo`` entry; see
``docs/algorithms.md``, "Adding a method".
"""

import dataclasses
from typing import Any, NamedTuple

from dart_jax.decode.ar import ARDecoder, Decoder
from dart_jax.decode.dart import dart_decoder, dart_gru_decoder
from dart_jax.decode.dartree import dartree_decoder, tree_options
from dart_jax.draft.dart_gru import DartGruDrafter
from dart_jax.draft.dart_head import DartHead
from dart_jax.draft.dflash import DFlashDrafter
from dart_jax.errors import InputError
from dart_jax.models.target import Target
from dart_jax.ngram.context import ContextNGramConfig
from dart_jax.sampling import SamplingConfig
from dart_jax.tree import TreeConfig
from dart_jax.tree.dartree import DARTreeConfig, resolve_method

# ------------------------------------------------------------ typed methods


def _check_drafter(method: str, drafter, kind: type, loader: str) -> None:
  if not isinstance(drafter, kind):
    raise InputError(f"{method} needs a {kind.__name__} ({loader}), got "
                     f"{type(drafter).__name__}")


@dataclasses.dataclass(frozen=True, eq=False)
class DART:
  """DART: a draft head's levels, a beam search with the N-gram term.

  head: a ``DartHead``; ngram: an ``NGram`` or ``NGramTable`` (None: no
  N-gram term); tree: the search's ``TreeConfig`` (None: the head's, else the
  default); context_ngram: True / a ``ContextNGramConfig`` / False (None: on,
  ``dart_jax.ngram.context``).
  """

  head: DartHead
  ngram: Any = None
  tree: TreeConfig | None = None
  context_ngram: bool | ContextNGramConfig | None = None

  def __post_init__(self):
    _check_drafter("DART", self.head, DartHead, "dj.load_dart")
    if self.tree is not None and not isinstance(self.tree, TreeConfig):
      raise InputError(f"DART's tree must be a TreeConfig, got {type(self.tree).__name__}")

  def decoder(self, target: Target, sampling: SamplingConfig, seed: int = 0,
              profile: bool = False) -> Decoder:
    return dart_decoder(target, self.head, sampling=sampling, seed=seed, ngram=self.ngram,
                        tree=self.tree, context_ngram=self.context_ngram, profile=profile)


class TreeFacts(NamedTuple):
  """What sizing a DARTree-style tree needs: the resolved tree name, the draft
  depths D, the vocabulary its logits cover and the target layers it taps."""

  tree: str
  num_depths: int
  vocab_size: int
  taps: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class DARTree:
  """DARTree and its baselines over a DFlash (or DFlash + Domino) drafter.

  tree: "dartree" (pruned), "dartree-fixed", "ddtree", "dflash-chain",
  "domino-chain" or "chain" (Domino's with a correction head, else DFlash's);
  config: the tree shape (``DARTreeConfig``; None: the drafter's measured
  settings where it carries them, as the shipped drafter does, else the
  defaults).
  """

  drafter: DFlashDrafter
  tree: str = "dartree"
  config: DARTreeConfig | None = None

  def __post_init__(self):
    _check_drafter("DARTree", self.drafter, DFlashDrafter,
                   "dj.load_dflash / dj.load_domino")

  def tree_facts(self) -> TreeFacts:
    c = self.drafter.config
    return TreeFacts(resolve_method(self.tree, self.drafter.domino), c.num_depths,
                     c.vocab_size, tuple(c.taps))

  def decoder(self, target: Target, sampling: SamplingConfig, seed: int = 0,
              profile: bool = False) -> Decoder:
    return dartree_decoder(target, self.drafter, resolve_method(self.tree,
                                                                self.drafter.domino),
                           _tree_config(self), sampling=sampling, seed=seed,
                           profile=profile)


@dataclasses.dataclass(frozen=True, eq=False)
class DartGru:
  """DART-GRU: a DART head's levels with the GRU correction, DARTree's trees.

  tree / config: as ``DARTree`` (the correction always exists, so "chain" is
  the corrected chain).
  """

  drafter: DartGruDrafter
  tree: str = "dartree"
  config: DARTreeConfig | None = None

  def __post_init__(self):
    _check_drafter("DART-GRU", self.drafter, DartGruDrafter, "dj.load_dart_gru")

  def tree_facts(self) -> TreeFacts:
    c = self.drafter.config.dart
    return TreeFacts(resolve_method(self.tree, True), c.num_levels, c.draft_vocab_size,
                     tuple(c.tap_layers))

  def decoder(self, target: Target, sampling: SamplingConfig, seed: int = 0,
              profile: bool = False) -> Decoder:
    return dart_gru_decoder(target, self.drafter, resolve_method(self.tree, True),
                            _tree_config(self), sampling=sampling, seed=seed,
                            profile=profile)


def _tree_config(method: "DARTree | DartGru") -> DARTreeConfig:
  """The method's tree, else its drafter's measured one, else the defaults."""
  return method.config or method.drafter.tree_config or DARTreeConfig()


Method = DART | DARTree | DartGru


def _dart_from_call(head, ngram, tree=None, context_ngram=None, **unknown) -> DART:
  if unknown:
    raise InputError(f"unknown DART option(s) {sorted(unknown)}; options: ngram, tree, "
                     "context_ngram")
  return DART(head, ngram, tree, context_ngram)


def _tree_method_from_call(cls, name: str, has_correction):
  def make(drafter, ngram, tree="dartree", tree_config=None, **overrides):
    if ngram is not None:
      raise InputError(f"{name} methods use no N-gram model; drop ngram=...")
    # Keyword overrides apply to the drafter's measured settings where it has them.
    tree, config = tree_options(tree, tree_config or drafter.tree_config, overrides,
                                has_correction(drafter))
    return cls(drafter, tree, config)

  return make


# The older ``draft=`` call: the first class the drafter is an instance of decides.
DECODERS = (
    (DartHead, _dart_from_call),
    (DFlashDrafter, _tree_method_from_call(DARTree, "DARTree", lambda d: d.domino)),
    (DartGruDrafter, _tree_method_from_call(DartGru, "DART-GRU", lambda d: True)),
)


def method_for(draft, ngram=None, **method_kwargs) -> Method:
  """The typed method of ``generate(..., draft=..., ngram=..., **method_kwargs)``."""
  for kind, make in DECODERS:
    if isinstance(draft, kind):
      return make(draft, ngram, **method_kwargs)
  raise InputError(f"draft={type(draft).__name__} is not a supported draft model; pass "
                   "a DartHead (dj.load_dart), a DFlashDrafter (dj.load_dflash / "
                   "dj.load_domino) or a DartGruDrafter (dj.load_dart_gru)")


def make_decoder(target: Target, sampling: SamplingConfig, seed: int, draft=None,
                 ngram=None, *, method: Method | None = None, profile: bool = False,
                 **method_kwargs) -> Decoder:
  """The decoder for a call of ``generate``: ``method`` (a typed method), else the
  one ``draft=`` and its options make (``method_for``), else plain decoding."""
  if method is not None:
    if draft is not None or ngram is not None or method_kwargs:
      raise InputError("pass either method=... or draft= / ngram= / tree options, "
                       "not both")
    if not isinstance(method, (DART, DARTree, DartGru)):
      raise InputError(f"method must be dj.DART, dj.DARTree or dj.DartGru, got "
                       f"{type(method).__name__}")
    return method.decoder(target, sampling, seed, profile)
  if draft is None:
    if ngram is not None or method_kwargs:
      raise InputError("ngram / tree options need a draft head (draft=...)")
    return ARDecoder(target, sampling, seed)
  return method_for(draft, ngram, **method_kwargs).decoder(target, sampling, seed, profile)


# ------------------------------------------------------------ named methods


@dataclasses.dataclass(frozen=True)
class MethodInfo:
  """One named method of the command lines.

  family: "ar", "dart", "dartree", "dart_gru" or "hf" (transformers, the
    reference implementation).
  drafter: the drafter kind it needs (``DRAFTER_KINDS``; None for ar / hf).
  tree: the ``generate`` tree name (DARTree / DART-GRU families).
  context_ngram: DART's context N-gram on or off.
  uses_budget: its tree size is a budget (``--dartree-budget``; DART's is
    ``--tree-budget``).
  """

  name: str
  family: str
  drafter: str | None = None
  tree: str | None = None
  context_ngram: bool = True
  uses_budget: bool = False

  @property
  def lossless(self) -> bool:
    """Speculative, so its greedy output must equal plain decoding's."""
    return self.family in ("dart", "dartree", "dart_gru")


# The drafters ``python -m train.main`` trains (``head.kind``), and the ones above need.
DRAFTER_KINDS = ("dart", "dflash", "domino", "dart_gru")

METHODS: dict[str, MethodInfo] = {m.name: m for m in (
    MethodInfo("ar", "ar"),
    MethodInfo("dart", "dart", "dart", uses_budget=True),
    MethodInfo("dart-no-context", "dart", "dart", context_ngram=False, uses_budget=True),
    MethodInfo("dflash-chain", "dartree", "dflash", "dflash-chain"),
    MethodInfo("domino-chain", "dartree", "domino", "domino-chain"),
    MethodInfo("ddtree", "dartree", "dflash", "ddtree", uses_budget=True),
    MethodInfo("dartree-fixed", "dartree", "domino", "dartree-fixed", uses_budget=True),
    MethodInfo("dartree", "dartree", "domino", "dartree", uses_budget=True),
    MethodInfo("dart-gru", "dart_gru", "dart_gru", "dartree", uses_budget=True),
    MethodInfo("dart-gru-fixed", "dart_gru", "dart_gru", "dartree-fixed", uses_budget=True),
    MethodInfo("dart-gru-chain", "dart_gru", "dart_gru", "chain"),
    MethodInfo("hf", "hf"),
)}
assert all(m.drafter in DRAFTER_KINDS + (None,) for m in METHODS.values())


def method_names(*, family: str | tuple[str, ...] | None = None,
                 drafter: str | tuple[str, ...] | None = None,
                 lossless: bool | None = None) -> tuple[str, ...]:
  """Registry names in registry order, filtered by family / drafter / lossless."""
  as_tuple = lambda v: (v,) if isinstance(v, str) else v
  return tuple(m.name for m in METHODS.values()
               if (family is None or m.family in as_tuple(family))
               and (drafter is None or m.drafter in as_tuple(drafter))
               and (lossless is None or m.lossless == lossless))
