"""`TreeConfig`: hyper-parameters of the DART tree search (``docs/algorithms.md``, "DART")."""

import dataclasses
from typing import Callable

import jax

from dart_jax.errors import ConfigError

TARGET_EOS = "target"  # TreeConfig.eos_id: the EOS of the target being decoded


def default_level_weight(level: int) -> float:
  """Weight of level `level`'s increment: (level + 1) ** -0.7."""
  return (level + 1) ** -0.7


def default_logit_weight(level: int) -> float:
  """Weight of the draft log-probability at `level`: 0.9 ** level."""
  return 0.9 ** level


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """DART beam-search settings (defaults = the reference release).

  Hashable and registered as a static pytree (no leaves), so it can be a
  static jit argument and passes through `jax.vmap(..., in_axes=None)`.
  The weight functions take the level (0-based) and return a Python float;
  use module-level functions (not fresh lambdas) so equal configs compare
  equal and jit caches hit.

  Attributes:
    topk: candidates per level (top-k of the draft logits).
    beam_width: beam members kept per level.
    remain_total: draft nodes kept in the tree (N).
    ngram_weight: weight of log P_ngram (levels >= 1 only).
    level_weight: level -> weight of the whole increment.
    logit_weight: level -> weight of the draft log-probability.
    eos_id: target token id of EOS; children ending in it are ranked after
      all others when the beam is cut (the reference's rule). ``"target"``
      (the default): the decoder uses its target's EOS (the tokenizer's first
      EOS id, as the reference does), so ``generate`` applies the rule unless
      the caller sets an id or None (no EOS rule). ``dart_search`` alone has no
      target: there ``"target"`` means no rule.
    eps: added to probabilities before the log.
  """
  topk: int = 25
  beam_width: int = 20
  remain_total: int = 60
  ngram_weight: float = 0.5
  level_weight: Callable[[int], float] = default_level_weight
  logit_weight: Callable[[int], float] = default_logit_weight
  eos_id: int | str | None = TARGET_EOS
  eps: float = 1e-10

  def __post_init__(self):
    for name in ("topk", "beam_width", "remain_total"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"TreeConfig.{name} must be an int >= 1, got "
                          f"{value!r}.")
    if not callable(self.level_weight) or not callable(self.logit_weight):
      raise ConfigError("TreeConfig.level_weight and logit_weight must be "
                        "callables level -> float.")
    if self.eos_id not in (None, TARGET_EOS) and (
        not isinstance(self.eos_id, int) or isinstance(self.eos_id, bool)
        or self.eos_id < 0):
      raise ConfigError(f"TreeConfig.eos_id must be a token id >= 0, None (no EOS "
                        f"rule) or {TARGET_EOS!r}, got {self.eos_id!r}.")
    if not self.eps > 0:
      raise ConfigError(f"TreeConfig.eps must be > 0, got {self.eps!r}.")

  @property
  def search_eos_id(self) -> int | None:
    """The EOS id the search ranks last: None when unset or still ``"target"``."""
    return self.eos_id if isinstance(self.eos_id, int) else None

  def with_target_eos(self, eos_id: int | None) -> "TreeConfig":
    """This config with a ``"target"`` EOS replaced by ``eos_id``."""
    if self.eos_id != TARGET_EOS:
      return self
    return dataclasses.replace(self, eos_id=eos_id)

  def beam_sizes(self, num_levels: int) -> tuple[int, ...]:
    """Beam members expanded at each level (1 at level 0)."""
    sizes = [1]
    for _ in range(num_levels - 1):
      sizes.append(min(self.beam_width, sizes[-1] * self.topk))
    return tuple(sizes)

  def num_scored(self, num_levels: int) -> int:
    """Children scored over all levels (candidates for the final top-N)."""
    return sum(self.beam_sizes(num_levels)) * self.topk

  def num_tree_nodes(self, num_levels: int) -> int:
    """Valid draft nodes of every tree: min(remain_total, num_scored)."""
    return min(self.remain_total, self.num_scored(num_levels))
