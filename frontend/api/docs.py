"""``/docs``: Swagger UI served from this process (no CDN), so it works offline."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles


def mount_docs(app: FastAPI) -> None:
    """Swagger UI served from this process (no CDN): ``/docs`` works offline."""
    import fastapi_offline

    static = Path(fastapi_offline.__file__).parent / "static"
    app.mount("/static-docs", StaticFiles(directory=static), name="static-docs")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="epd-pipeline API - docs",
            swagger_js_url="/static-docs/swagger-ui-bundle.js",
            swagger_css_url="/static-docs/swagger-ui.css",
            swagger_favicon_url="/static-docs/favicon.png",
        )
