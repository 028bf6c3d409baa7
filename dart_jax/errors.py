"""Exceptions raised by dart-jax. Each says what was wrong and what to do."""


class DartJaxError(Exception):
  """Base class of all dart-jax errors."""


class ConfigError(DartJaxError, ValueError):
  """A model / head / tree configuration is invalid or unsupported."""


class CheckpointError(DartJaxError, ValueError):
  """A checkpoint file or directory is missing, corrupt or inconsistent."""


class InputError(DartJaxError, ValueError):
  """A prompt or generation argument is invalid (empty, too long, out of range)."""
