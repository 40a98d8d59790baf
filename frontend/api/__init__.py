"""The HTTP submit-and-poll API (``epd api``): see ``frontend.api.app``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from frontend.api.app import create_app

if TYPE_CHECKING:
    from fastapi import FastAPI

    from runtime.settings import Settings

__all__ = ["app_factory", "create_app", "process_app"]


def app_factory():  # type: ignore[no-untyped-def]
    """The app configured from ``EPD_*`` (uvicorn's ``--factory`` entry, one per worker)."""
    from runtime.settings import Settings

    return process_app(Settings())


def process_app(settings: Settings) -> FastAPI:
    """The app of a process that serves the API (``epd api``, ``epd stack``): the API runs no
    model, so the process's torch ops take one thread (``runtime.torch_threads``). Tests build
    apps with :func:`create_app`, which leaves the process as it is."""
    from runtime.torch_threads import apply_torch_threads

    apply_torch_threads(settings, model_on_cpu=False)
    return create_app(settings)
