"""The renderer's refusals: :class:`RenderError` (a ``ValidationError`` naming the rule and the
item), an image's error factory, and the render time limit (``render.timeout``).

Apart from :mod:`producers.render` so that its phases (:mod:`producers.prompt_tokens`,
:mod:`producers.placeholders`) raise the same error without importing the renderer.
"""

from __future__ import annotations

import time

from media.pictures import ErrorFactory
from schemas.errors import ValidationError


class RenderError(ValidationError):
    """A request the renderer cannot turn into an event; names the rule and the item."""


def image_error(index: int) -> ErrorFactory:
    """Refusals of image ``index`` as ``RenderError``s naming it."""

    def make(rule: str, msg: str) -> RenderError:
        return RenderError(rule, msg, modality="image", item=index)

    return make


def render_timeout(modality: str | None, item: int | None) -> RenderError:
    """Rule ``render.timeout``: the render ran past ``EPD_API_RENDER_TIMEOUT_S`` (at ``item``
    of ``modality`` when it stopped between items)."""
    return RenderError(
        "render.timeout",
        "rendering ran past the render time limit (EPD_API_RENDER_TIMEOUT_S); send fewer, "
        "shorter or smaller inputs",
        modality=modality,
        item=item,
    )


def check_time(give_up_at: float | None, modality: str, item: int) -> None:
    """Refuse with ``render.timeout`` once ``time.monotonic()`` is past ``give_up_at``."""
    if give_up_at is not None and time.monotonic() > give_up_at:
        raise render_timeout(modality, item)
