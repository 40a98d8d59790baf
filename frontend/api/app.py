"""The HTTP front door: the app, its lifespan, its error handlers and its routers.

``create_app(settings)`` builds the FastAPI app; ``epd api`` serves it with uvicorn. The routes
live in ``frontend.api.routes`` (one router per resource) and submit through the shared
:class:`producers.intake.Intake`; what they share is :class:`frontend.api.state.ApiState`,
wired in the lifespan. Everything a request touches is shared state in Redis (status records,
idempotency claims, the in-flight set, cancel flags), so API replicas are interchangeable.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from frontend.api.docs import mount_docs
from frontend.api.errors import (
    ApiError,
    from_refusal,
    from_validation,
    pydantic_error,
    unavailable,
)
from frontend.api.metrics import Metrics
from frontend.api.observation import Observation
from frontend.api.openai_compat.errors import is_openai_path, openai_body
from frontend.api.openapi import install_openapi
from frontend.api.routes import admin, chat, model_list, ops, requests, responses, vllm
from frontend.api.state import ApiState
from producers.refusal import Refused
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from schemas.errors import ValidationError

log = logging.getLogger("epd.api")

CLIENT_CLOSED = 499
"""The status a request whose client went away is counted under (nginx's "client closed
request"): nobody receives it."""

DESCRIPTION = (
    "Submit-and-poll front door of the encode/prefill/decode pipeline. `POST /v1/requests` "
    "renders and enqueues a request and answers 202 at once; poll `GET /v1/requests/{id}` "
    "(optionally `?wait=SECONDS`), follow `/events` (SSE: status changes and tokens) or "
    "`DELETE` to cancel. Errors are "
    '`{"error": {"code", "message", "rule"?}}`. The OpenAI-compatible routes '
    "(`/v1/chat/completions`, `/v1/responses`, `/v1/models`) take the `openai` client on the "
    "same intake, tenants and limits; their errors are in OpenAI's shape "
    '`{"error": {"message", "type", "param", "code"}}` with the same status codes.'
)


def create_app(settings: Settings) -> FastAPI:
    """The API app for ``settings`` (services are connected in the lifespan)."""
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await ApiState.open(settings, metrics)
        if state.tenants.open:
            log.warning(
                "EPD_API_TOKENS is not set: the API is OPEN (no authentication, one shared "
                "tenant). Set EPD_API_TOKENS=TOKEN=TENANT,... to require bearer tokens."
            )
        else:
            log.info("API tokens configured: %d tenant(s)", len(state.tenants.names))
        app.state.api = state
        await state.start()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(
        title="epd-pipeline API",
        version="1",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.metrics = metrics

    def limits() -> RequestLimits:
        state: ApiState | None = getattr(app.state, "api", None)
        if state is not None:
            return state.limits
        from runtime.model import load_render_info  # a schema asked for before start-up

        info = load_render_info(settings.model)
        return RequestLimits.from_settings(
            settings, vocab_size=info.vocab_size, model_context=info.context_length
        )

    install_openapi(app, limits, model=settings.model_name())
    mount_docs(app)
    add_error_handlers(app, settings)
    add_observation(app, metrics)
    for router in (
        requests.router,
        vllm.router,
        chat.router,
        responses.router,
        model_list.router,
        ops.router,
        admin.router,
    ):
        app.include_router(router)
    return app


def _answer(request: Request, exc: ApiError) -> JSONResponse:
    """``exc`` in the shape of the route it answers: OpenAI's on the OpenAI-compatible
    routes, the native one elsewhere (same status codes either way)."""
    body = openai_body(exc) if is_openai_path(request.url.path) else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def _api_error(r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _answer(r, exc)


async def _refused(r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Refused)
    return _answer(r, from_refusal(exc))


async def _rejected(r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return _answer(r, from_validation(exc))


async def _schema(r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _answer(r, pydantic_error(exc))


async def _http(r: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _answer(r, ApiError(exc.status_code, code, str(exc.detail)))


Handler = Callable[[Request, Exception], Awaitable[Response]]


def _outage_handlers(retry_after: int, metrics: Metrics) -> list[tuple[type[Exception], Handler]]:
    """The answers to a dependency that failed (503 with ``Retry-After``), to a client gone
    before its body was read (499), and to anything else (500, logged)."""

    async def redis_down(r: Request, exc: Exception) -> JSONResponse:
        log.warning("Redis error: %s", exc)
        return _answer(r, unavailable(f"Redis unavailable: {exc}", retry_after, rule="redis"))

    async def kafka_down(r: Request, exc: Exception) -> JSONResponse:
        log.warning("Kafka error: %s", exc)
        return _answer(r, unavailable(f"Kafka unavailable: {exc}", retry_after, rule="kafka"))

    async def disconnected(r: Request, exc: Exception) -> Response:
        # The client's event, not the server's: no traceback, no 500 (nobody reads the answer).
        route = getattr(r.scope.get("route"), "path", "unmatched")
        log.info("client disconnected before its request was read: %s %s", r.method, route)
        metrics.disconnected(route, "body")
        return Response(status_code=CLIENT_CLOSED)

    async def internal(r: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, (ConnectionError, OSError)):
            return _answer(r, unavailable(str(exc), retry_after, rule="dependency"))
        log.exception("unhandled error", exc_info=exc)
        return _answer(r, ApiError(500, "internal", "internal error; see the API log"))

    return [
        (ClientDisconnect, disconnected),
        (RedisError, redis_down),
        (KafkaError, kafka_down),
        (Exception, internal),
    ]


def add_error_handlers(app: FastAPI, settings: Settings) -> None:
    """Every error, raised anywhere in a route, as one JSON shape with a code (and a rule);
    a client gone before its body was read as what it is (499, logged at INFO, counted by
    ``epd_api_client_disconnects``), never a server error."""
    handlers: list[tuple[type[Exception], Handler]] = [
        (ApiError, _api_error),
        (Refused, _refused),
        (ValidationError, _rejected),
        (RequestValidationError, _schema),
        (StarletteHTTPException, _http),
        *_outage_handlers(settings.api_retry_after_s, app.state.metrics),
    ]
    for kind, handler in handlers:
        app.add_exception_handler(kind, handler)


def add_observation(app: FastAPI, metrics: Metrics) -> None:
    """Latency by route and HTTP requests in flight (:class:`Observation`)."""
    app.add_middleware(Observation, metrics=metrics)
