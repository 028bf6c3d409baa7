"""DART head training: ``python -m train.main`` (see ``train/README.md``)."""
