"""Replacement code of the patches in ``patches/``, one module per patch, imported when its targets are patched
(so that ``import torchpatches`` compiles none of it)."""
