"""Draft models: the DART head (and, later, DFlash + Domino for DARTree)."""

from dart_jax.draft.dart_head import (DartConfig, DartHead, DartHeadModule, load_dart,
                                      save_dart)

__all__ = ["DartConfig", "DartHead", "DartHeadModule", "load_dart", "save_dart"]

from dart_jax.draft.dflash import (DFlashConfig, DFlashDrafter, DFlashModule,
                                   default_target_layer_ids, load_dflash, load_domino,
                                   save_dflash)

__all__ += ["DFlashConfig", "DFlashDrafter", "DFlashModule", "default_target_layer_ids",
            "load_dflash", "load_domino", "save_dflash"]

from dart_jax.draft.dart_gru import (DartGruConfig, DartGruDrafter, load_dart_gru,
                                     save_dart_gru)

__all__ += ["DartGruConfig", "DartGruDrafter", "load_dart_gru", "save_dart_gru"]
