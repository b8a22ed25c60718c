"""Fixtures of atom-plugin's tests (helpers live in ``atom_harness``, a unique module name)."""

from atom_harness import ckpt_factory, v3_ckpt

__all__ = ["ckpt_factory", "v3_ckpt"]
