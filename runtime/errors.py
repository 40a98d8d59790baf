"""Errors of the runtime floor that the CLI turns into a message and an exit code.

Kept free of heavy imports (no torch, no transformers) so ``epd`` can catch them without paying
for the model stack when a command never touches it.
"""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model spec that cannot be loaded (missing path, unsupported family, bad device)."""
