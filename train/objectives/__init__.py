"""Training objectives, one module per drafter kind, and the table the loop reads.

Each module is an objective: what ``train.loop`` needs to train one kind of
drafter, so that the loop itself names no kind.

  KINDS          the ``head.kind`` values it trains
  CONFIG_TYPE    the drafter config class it trains (``StepSettings.head_config``)
  make(config, target, rows) -> drafter      fresh, or from ``init_from``
  step_options(config, drafter) -> dict      its ``StepSettings`` fields
  split(drafter, param_dtype) -> (params, buffers)   nested dicts; params train
  from_state(head_config, params, buffers) -> drafter   host arrays, for export
  forward(settings, target_model, params, buffers, batch, key, step, compute)
      -> (loss, stats)                       one batch, params differentiable
  step_metrics(settings, step) -> dict       extra per-step scalars (jit-safe)
  summarize(settings, stats) -> dict         host-side metrics of summed stats
  feature_spec(drafter) -> FeatureSpec       what the cached target features
                                             hold (taps; DART: also the teacher)
  export(drafter, directory)                 the drafter's release format
"""

from types import ModuleType

from dart_jax.errors import ConfigError
from train.objectives import dart, dart_gru, dflash

_MODULES: tuple[ModuleType, ...] = (dart, dflash, dart_gru)
OBJECTIVES: dict[str, ModuleType] = {kind: m for m in _MODULES for kind in m.KINDS}
_BY_CONFIG: dict[type, ModuleType] = {m.CONFIG_TYPE: m for m in _MODULES}


def for_kind(kind: str) -> ModuleType:
  """The objective of ``head.kind``."""
  if kind not in OBJECTIVES:
    raise ConfigError(f"head.kind must be one of {', '.join(OBJECTIVES)}, got {kind!r}")
  return OBJECTIVES[kind]


def for_config(head_config) -> ModuleType:
  """The objective that trains drafters of this config."""
  return for_config_type(type(head_config))


def for_config_type(config_type: type) -> ModuleType:
  return _BY_CONFIG[config_type]
