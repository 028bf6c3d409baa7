"""Draft models: the DART head (and, later, DFlash + Domino for DARTree)."""

from dart_jax.draft.dart_head import (DartConfig, DartHead, DartHeadModule, load_dart,
                                      save_dart)

__all__ = ["DartConfig", "DartHead", "DartHeadModule", "load_dart", "save_dart"]
