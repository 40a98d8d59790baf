"""The HTTP submit-and-poll API (``epd api``): see ``frontend.api.app``."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from frontend.api.app import create_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from contextlib import AbstractAsyncContextManager

    from fastapi import FastAPI

    from runtime.settings import Settings

__all__ = ["app_factory", "create_app", "process_app"]


def app_factory():  # type: ignore[no-untyped-def]
    """The app configured from ``EPD_*`` (uvicorn's ``--factory`` entry, one per worker)."""
    from runtime.settings import Settings

    return process_app(Settings())


def process_app(settings: Settings) -> FastAPI:
    """The app of a process that serves the API (``epd api``, each of its ``--workers``, and
    ``epd stack``): the API runs no model, so the process's torch ops take one thread
    (``runtime.torch_threads``); once the app has started, the heap it built leaves the
    collector's full passes (``runtime.heap``). Tests build apps with :func:`create_app`,
    which leaves the process as it is."""
    from runtime.torch_threads import apply_torch_threads

    apply_torch_threads(settings, model_on_cpu=False)
    app = create_app(settings)
    app.router.lifespan_context = _freezing_after_start(app.router.lifespan_context)
    return app


def _freezing_after_start(
    lifespan: Callable[[Any], AbstractAsyncContextManager[Any]],
) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
    """``lifespan``, freezing the start-up heap once it has started (what lives then lives as
    long as the process: torch, transformers, the processor, the clients)."""

    @contextlib.asynccontextmanager
    async def frozen(app: Any) -> AsyncIterator[Any]:
        from runtime.heap import freeze_startup_heap

        async with lifespan(app) as state:
            freeze_startup_heap()
            yield state

    return frozen
