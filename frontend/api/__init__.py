"""The HTTP submit-and-poll API (``epd api``): see ``frontend.api.app``."""

from __future__ import annotations

from frontend.api.app import create_app

__all__ = ["app_factory", "create_app"]


def app_factory():  # type: ignore[no-untyped-def]
    """The app configured from ``EPD_*`` (uvicorn's ``--factory`` entry, one per worker)."""
    from runtime.settings import Settings

    return create_app(Settings())
