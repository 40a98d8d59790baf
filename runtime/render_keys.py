"""What the fan-out reads of a model, as plain data: the fingerprint and processor-config digest
its store keys are hashed with, and the processor numbers its input limits come from.

A :class:`~runtime.model.RenderInfo` holds all of it, but loading one imports torch and
transformers (the tiny models' fingerprint is over seeded weights; the processor config is
transformers' ``to_dict()``, defaults included). The render router needs only these few values:
:func:`render_keys_apart` computes them in a child process, which exits before the router
consumes anything, so the router itself never holds the model libraries. The child runs the
same code a renderer runs (:func:`render_keys_of` over ``load_render_info``), so both sides
hash alike by construction.

``python -m runtime.render_keys SPEC`` prints the keys as one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.errors import ModelLoadError
from runtime.processor_limits import processor_max_pixels, processor_temporal_patch

_ROOT = Path(__file__).resolve().parents[1]
"""The directory holding this package (the child imports the same code)."""


@dataclass(frozen=True, slots=True)
class RenderKeys:
    """The fan-out's view of a model: no processor object, no tokenizer, no weights."""

    model_name: str
    fingerprint: str
    processor_digest: str
    """Hex of ``schemas.signing.processor_digest`` over the processor's ``to_dict()``."""
    max_pixels: int
    """The processor's resize cap (``runtime.processor_limits.processor_max_pixels``)."""
    temporal_patch_size: int

    def to_json(self) -> str:
        """One line of JSON (what the child prints)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RenderKeys:
        """The keys from :meth:`to_json`'s line."""
        return cls(**json.loads(text))


def render_keys_of(info: Any) -> RenderKeys:
    """The keys of a loaded ``RenderInfo`` (or ``ModelBundle``)."""
    from schemas.signing import processor_digest

    proc = info.image_processor
    return RenderKeys(
        model_name=info.model_name,
        fingerprint=info.fingerprint,
        processor_digest=processor_digest(proc.to_dict()).hex(),
        max_pixels=processor_max_pixels(proc),
        temporal_patch_size=processor_temporal_patch(proc),
    )


def load_render_keys(spec: str) -> RenderKeys:
    """The keys of ``spec``, loaded in this process (imports torch and transformers)."""
    from runtime.model import load_render_info

    return render_keys_of(load_render_info(spec))


async def render_keys_apart(spec: str) -> RenderKeys:
    """The keys of ``spec``, loaded by a child process: this one imports neither torch nor
    transformers. A load error in the child is a :class:`ModelLoadError` here, with its
    message; a process that holds the model libraries already loads them itself."""
    if "runtime.model" in sys.modules:  # paid for already: a child would only cost time
        return await asyncio.to_thread(load_render_keys, spec)
    path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "runtime.render_keys",
        spec,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
    )
    out, err = await child.communicate()
    if child.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise ModelLoadError(
            f"cannot load the render keys of {spec!r}: {lines[-1] if lines else child.returncode}"
        )
    return RenderKeys.from_json(out.decode().strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    """Print the keys of ``argv[0]`` as JSON; a load error is one line on stderr, exit 2."""
    try:
        keys = load_render_keys(argv[0])
    except ModelLoadError as e:
        print(f"ModelLoadError: {e}", file=sys.stderr)
        return 2
    print(keys.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
