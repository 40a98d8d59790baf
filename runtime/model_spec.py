"""What a model spec names, read without loading it: its family, from the tiny name or the
checkpoint's ``config.json``.

Kept apart from :mod:`runtime.model` (torch and transformers) so that the command line can
refuse an unsupported checkpoint, and a worker that runs no model (the render router) can name
its model, without importing either.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import ModelLoadError
from schemas.families import FAMILIES, TINY_SPECS, ModelFamily, UnsupportedModelType, family


def checkpoint_dir(spec: str) -> Path:
    """The checkpoint directory ``spec`` names; ModelLoadError when it is not one."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {spec!r} is neither a tiny spec ({', '.join(sorted(TINY_SPECS))}) nor a "
            "local checkpoint directory"
        )
    return path


def model_family(spec: str) -> ModelFamily:
    """The family ``spec`` names, from its tiny name or its checkpoint's ``config.json``.

    Cheap (reads one JSON file, loads no weights): the CLI calls it at start-up so an
    unsupported checkpoint is refused with the list of supported ``model_type`` values before
    anything else starts.
    """
    if spec in TINY_SPECS:
        return FAMILIES[TINY_SPECS[spec]]
    path = checkpoint_dir(spec)
    cfg_file = path / "config.json"
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"cannot read {cfg_file}: {e}") from None
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{cfg_file} names no model_type")
    try:
        return family(model_type)
    except UnsupportedModelType as e:
        raise ModelLoadError(f"checkpoint {path}: {e}") from None
