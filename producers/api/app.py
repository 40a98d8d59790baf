"""The HTTP front door: submit (render + fan-out), poll, long-poll, events, cancel.

One ``create_app(settings)`` builds the FastAPI app; ``epd api`` serves it with uvicorn.
Everything a request touches is shared state in Redis (status records, idempotency claims, the
in-flight set, cancel flags), so API replicas are interchangeable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from producers.api.admission import LagMonitor
from producers.api.docs import mount_docs
from producers.api.errors import (
    ApiError,
    bad_request,
    from_validation,
    not_found,
    throttled,
    unavailable,
)
from producers.api.events import SSE_EVENT_SCHEMA, event_stream, is_stream_id
from producers.api.idempotency import IdempotencyStore
from producers.api.intake import SubmitInput, parse_json_submit, parse_multipart_submit, read_body
from producers.api.models import (
    ERROR_RESPONSES,
    Accepted,
    Health,
    RequestStatus,
    Status,
    SubmitRequest,
)
from producers.api.state import ApiState, Metrics, connect_kafka, tenant_salt
from producers.api.views import status_view
from producers.fanout import FanoutStats, build_fanout
from producers.render import Renderer
from runtime.kafka import KafkaPublisher
from runtime.redis_client import redis_client
from runtime.settings import Settings
from runtime.status_store import StatusNotifier, StatusStore
from runtime.tracing import TRACEPARENT, current_carrier, new_traceparent, stage_span, trace_id_of
from schemas.errors import ValidationError
from schemas.topics import Topics
from schemas.types import (
    TERMINAL_STATUSES,
    RenderEvent,
    ResultEvent,
    SamplingParams,
    now_ms,
)

log = logging.getLogger("epd.api")

API_PREFIX = "/v1"


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(settings: Settings) -> FastAPI:
    """The API app for ``settings`` (services are connected in the lifespan)."""
    metrics = Metrics()
    tenants = settings.api_tenants()
    token_list = [(tok.encode(), name) for tok, name in tenants.items()]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from runtime.model import load_render_info
        from runtime.stores import open_store

        if tenants:
            log.info("API tokens configured: %d tenant(s)", len(set(tenants.values())))
        else:
            log.warning(
                "EPD_API_TOKENS is not set: the API is OPEN (no authentication, one shared "
                "tenant). Set EPD_API_TOKENS=TOKEN=TENANT,... to require bearer tokens."
            )
        topics = Topics(settings.topic_prefix)
        # A bounded pool that waits: a burst of submits queues for connections, never fails.
        client = redis_client(settings, socket_connect_timeout=2.0, socket_timeout=10.0)
        status = StatusStore(client, prefix=settings.topic_prefix, ttl_s=settings.status_ttl_s)
        info = await asyncio.to_thread(load_render_info, settings.model)
        store = open_store(settings.embedding_store_url)
        publisher = KafkaPublisher.for_pipeline(settings, topics)
        state = ApiState(
            settings=settings,
            topics=topics,
            redis=client,
            status=status,
            notifier=StatusNotifier(status),
            idempotency=IdempotencyStore(
                client, settings.topic_prefix, settings.api_idempotency_ttl_s
            ),
            renderer=Renderer.for_settings(
                info, settings, max_video_bytes=settings.api_max_video_bytes
            ),
            fanout=build_fanout(settings, store, info, publisher, record=status.apply),
            lag=LagMonitor(settings, topics),
            tenants=tenants,
            render_slots=asyncio.Semaphore(max(1, settings.api_render_concurrency)),
            publisher=publisher,
        )
        app.state.api = state
        await state.notifier.start()
        await state.lag.start()
        # Kafka may come up after the API (compose starts them together): connect in the
        # background; until then submissions answer 503 and /readyz says why.
        connect = asyncio.create_task(connect_kafka(state), name="kafka-connect")
        try:
            yield
        finally:
            connect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connect
            for task in list(state.tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, 10)
            await state.lag.close()
            await state.notifier.close()
            with contextlib.suppress(Exception):
                await state.publisher.stop()
            await store.close()
            await client.aclose()

    app = FastAPI(
        title="epd-pipeline API",
        version="1",
        description=(
            "Submit-and-poll front door of the encode/prefill/decode pipeline. `POST "
            "/v1/requests` renders and enqueues a request and answers 202 at once; poll `GET "
            "/v1/requests/{id}` (optionally `?wait=SECONDS`), follow `/events` (SSE) or "
            '`DELETE` to cancel. Errors are `{"error": {"code", "message", "rule"?}}`.'
        ),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    mount_docs(app)

    def state_of(request: Request) -> ApiState:
        st: ApiState = request.app.state.api
        return st

    # ---------------------------------------------------------------- errors and middleware

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ())]
        return _error_response(
            ApiError(
                422,
                "validation_failed",
                f"{'.'.join(loc)}: {first.get('msg', 'invalid')}",
                rule="request.schema",
                field=loc[-1] if loc else None,
            )
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error_response(ApiError(exc.status_code, code, str(exc.detail)))

    @app.exception_handler(RedisError)
    async def _redis_down(_request: Request, exc: RedisError) -> JSONResponse:
        log.warning("Redis error: %s", exc)
        return _error_response(
            unavailable(f"Redis unavailable: {exc}", settings.api_retry_after_s, rule="redis")
        )

    @app.exception_handler(KafkaError)
    async def _kafka_down(_request: Request, exc: KafkaError) -> JSONResponse:
        log.warning("Kafka error: %s", exc)
        return _error_response(
            unavailable(f"Kafka unavailable: {exc}", settings.api_retry_after_s, rule="kafka")
        )

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, (ConnectionError, OSError)):
            return _error_response(
                unavailable(str(exc), settings.api_retry_after_s, rule="dependency")
            )
        log.exception("unhandled error")
        return _error_response(ApiError(500, "internal", "internal error; see the API log"))

    @app.middleware("http")
    async def _observe(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        t0 = time.perf_counter()
        metrics.http_in_flight.inc()
        code = 500
        try:
            response = await call_next(request)
            code = response.status_code
            return response
        finally:
            metrics.http_in_flight.dec()
            route = request.scope.get("route")
            path = getattr(route, "path", "unmatched")
            metrics.latency.labels(request.method, path, str(code)).observe(
                time.perf_counter() - t0
            )

    # ------------------------------------------------------------------------- auth

    def tenant_of(request: Request) -> str | None:
        if not tenants:
            return None
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        tenant = None
        if scheme.lower() == "bearer":
            given = token.strip().encode()
            # Constant-time comparison against every token: timing says nothing about them.
            for known, name in token_list:
                if hmac.compare_digest(known, given):
                    tenant = name
        if tenant is None:
            raise ApiError(
                401,
                "unauthorized",
                "a valid bearer token is required (Authorization: Bearer TOKEN)",
                rule="auth.token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant

    async def owned_record(st: ApiState, request_id: str, tenant: str | None) -> dict[str, Any]:
        rec = await st.status.get(request_id)
        # Another tenant's request is "not found", not "forbidden": ids reveal nothing.
        if rec is None or rec.get("tenant") != tenant:
            raise not_found(request_id)
        return rec

    def observed(rec: dict[str, Any]) -> dict[str, Any]:
        return status_view(rec)

    # ------------------------------------------------------------------------ submit

    body_doc = {
        "required": True,
        "content": {
            "application/json": {
                "schema": SubmitRequest.model_json_schema(),
                "example": SubmitRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
            },
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "prompt": {"type": "string"},
                        "token_ids": {"type": "string", "description": "JSON list"},
                        "images": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                        },
                        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 4096},
                        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                        "ignore_eos": {"type": "boolean"},
                        "cache_salt": {"type": "string"},
                        "deadline_s": {"type": "number"},
                        "metadata": {"type": "string", "description": "JSON object"},
                    },
                }
            },
        },
    }
    idem_param = {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "maxLength": 255},
        "description": "same key + same body: the same request; same key + other body: 409",
    }

    @app.post(
        f"{API_PREFIX}/requests",
        status_code=202,
        response_model=Accepted,
        responses=_with_errors(
            {200: {"model": Accepted, "description": "seen before (Idempotency-Key)"}}
        ),
        openapi_extra={"requestBody": body_doc, "parameters": [idem_param]},
        summary="Submit a request (render + enqueue); answers 202 without waiting for a GPU",
        tags=["requests"],
    )
    async def submit(request: Request) -> JSONResponse:
        st = state_of(request)
        tenant = tenant_of(request)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in ("application/json", "multipart/form-data"):
            raise ApiError(
                415,
                "unsupported_media_type",
                "send application/json or multipart/form-data",
                rule="body.content_type",
            )
        await read_body(request, settings.api_max_body_bytes)
        if ctype == "application/json":
            inp = parse_json_submit(request._body, settings)
        else:
            inp = await parse_multipart_submit(request, settings)
        if inp.temperature != 0.0:
            raise ApiError(
                422,
                "validation_failed",
                "only greedy decoding (temperature 0) is supported",
                rule="sampling.temperature",
                field="temperature",
            )
        if (inp.prompt is None) == (inp.token_ids is None):
            raise ApiError(
                422,
                "validation_failed",
                "give exactly one of prompt or token_ids",
                rule="render.prompt",
                field="prompt",
            )

        async def render(rid: str) -> RenderEvent:
            return await st.renderer.render_async(
                rid,
                timeout_s=settings.api_render_timeout_s,
                prompt=inp.prompt,
                token_ids=inp.token_ids,
                images=inp.images,
                videos=inp.videos,
                sampling=SamplingParams(
                    max_tokens=inp.max_tokens, temperature=0.0, ignore_eos=inp.ignore_eos
                ),
                cache_salt=tenant_salt(tenant, inp.cache_salt),
                deadline_ms=_deadline(inp),
            )

        return await accept(st, request, tenant, inp.fingerprint(), render, metadata=inp.metadata)

    async def accept(
        st: ApiState,
        request: Request,
        tenant: str | None,
        fingerprint: str,
        render: Callable[[str], Awaitable[RenderEvent]],
        *,
        metadata: dict[str, str] | None,
        foreign_labels: bool = False,
    ) -> JSONResponse:
        """Admission, idempotency, render and fan-out shared by both submit routes.

        ``foreign_labels``: the items' ``mm_hash`` come from another renderer (vLLM); they stay
        as labels while the fan-out keys the store by its own hash."""
        idem_key = request.headers.get("idempotency-key")
        rid = uuid.uuid4().hex
        if idem_key is not None:
            st.idempotency.check_key(idem_key)
            owned, found = await st.idempotency.claim(tenant, idem_key, fingerprint, rid)
            if not owned:
                metrics.requests.labels("duplicate").inc()
                rec = await st.status.get(found)
                return _accepted(found, rec["status"] if rec else "queued", 200)
        try:
            if not st.kafka_ready.is_set():
                metrics.requests.labels("unavailable").inc()
                raise unavailable(
                    "Kafka is not connected yet", settings.api_retry_after_s, rule="kafka"
                )
            if st.lag.over(settings.api_max_encode_lag):
                metrics.requests.labels("throttled").inc()
                raise throttled(
                    f"the encoders are {st.lag.lag} events behind (limit "
                    f"{settings.api_max_encode_lag})",
                    settings.api_retry_after_s,
                    rule="admission.encode_lag",
                )
            if not await st.status.admit(rid, settings.api_max_in_flight):
                metrics.requests.labels("throttled").inc()
                raise throttled(
                    f"{settings.api_max_in_flight} requests are in flight",
                    settings.api_retry_after_s,
                    rule="admission.in_flight",
                )
        except BaseException:
            if idem_key is not None:
                await st.idempotency.release(tenant, idem_key, rid)
            raise
        # From here the work runs to its end even if the client goes away: a request is either
        # fully enqueued or forgotten, never half-enqueued.
        traceparent = request.headers.get(TRACEPARENT)
        if trace_id_of(traceparent) is None:
            traceparent = new_traceparent()  # absent or malformed: this request starts a trace
        task = asyncio.create_task(
            enqueue(st, rid, tenant, render, metadata, foreign_labels, traceparent or "")
        )
        st.tasks.add(task)
        task.add_done_callback(st.tasks.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise  # the client left; the enqueue goes on and keeps its Idempotency-Key
        except Exception:
            # Not enqueued (the task forgot the request): a retry with this key starts afresh.
            if idem_key is not None:
                with contextlib.suppress(Exception):
                    await st.idempotency.release(tenant, idem_key, rid)
            raise
        metrics.requests.labels("queued").inc()
        return _accepted(rid, "queued", 202)

    async def enqueue(
        st: ApiState,
        rid: str,
        tenant: str | None,
        render: Callable[[str], Awaitable[RenderEvent]],
        metadata: dict[str, str] | None,
        foreign_labels: bool,
        traceparent: str,
    ) -> FanoutStats:
        with stage_span("api", {TRACEPARENT: traceparent}, request_id=rid):
            return await _enqueue_traced(st, rid, tenant, render, metadata, foreign_labels)

    async def _enqueue_traced(
        st: ApiState,
        rid: str,
        tenant: str | None,
        render: Callable[[str], Awaitable[RenderEvent]],
        metadata: dict[str, str] | None,
        foreign_labels: bool,
    ) -> FanoutStats:
        created = False
        try:
            t0 = now_ms()
            created = await st.status.create(
                rid, {"tenant": tenant, "metadata": metadata, "render": {"started_ms": t0}}
            )
            async with st.render_slots:
                t_render = time.perf_counter()
                ev = await render(rid)
                render_s = time.perf_counter() - t_render
            metrics.render.observe(render_s)
            await st.status.update_fields(
                rid,
                {
                    "render": {"started_ms": t0, "finished_ms": now_ms(), "ms": render_s * 1000},
                    "items": [
                        {"modality": m, "index": i, "mm_hash": h} for m, i, h in ev.features.items()
                    ],
                },
            )
            ev.trace.update(current_carrier())  # the request's trace travels with its events
            stats = await st.fanout.publish(ev, foreign_labels=foreign_labels)
        except ValidationError as exc:
            metrics.requests.labels("rejected").inc()
            await _forget(st, rid, created)
            raise from_validation(exc) from None
        except (KafkaError, RedisError, OSError) as exc:
            metrics.requests.labels("unavailable").inc()
            # Some events may be out already: the record says failed (never "queued" forever),
            # and the workers' results cannot override the first terminal status.
            with contextlib.suppress(Exception):
                await st.status.apply(
                    ResultEvent(
                        rid,
                        "api",
                        "failed",
                        error=_error_info("enqueue_failed", f"enqueue failed: {exc}"),
                    )
                )
            with contextlib.suppress(Exception):
                await st.status.release(rid)
            raise unavailable(
                f"cannot enqueue: {exc}", settings.api_retry_after_s, rule="enqueue"
            ) from None
        except BaseException:
            await _forget(st, rid, created)
            raise
        await st.status.update_fields(rid, {"cached": stats.cached})
        return stats

    async def _forget(st: ApiState, rid: str, created: bool) -> None:
        with contextlib.suppress(Exception):
            if created:
                await st.status.delete(rid)
            else:
                await st.status.release(rid)

    def _accepted(rid: str, status: str, code: int) -> JSONResponse:
        url = f"{API_PREFIX}/requests/{rid}"
        body = {
            "request_id": rid,
            "status": status,
            "status_url": url,
            "events_url": f"{url}/events",
        }
        return JSONResponse(body, status_code=code, headers={"Location": url})

    # -------------------------------------------------------------------- vLLM interop

    @app.post(
        f"{API_PREFIX}/vllm/generate",
        status_code=202,
        response_model=Accepted,
        responses=_with_errors(
            {200: {"model": Accepted, "description": "seen before (Idempotency-Key)"}}
        ),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "description": "a vLLM render response or GenerateRequest",
                            "required": ["token_ids", "features"],
                            "properties": {
                                "token_ids": {"type": "array", "items": {"type": "integer"}},
                                "features": {"type": "object"},
                                "sampling_params": {"type": "object"},
                            },
                        }
                    }
                },
            },
            "parameters": [idem_param],
        },
        summary="Fan out a vLLM render response / GenerateRequest (full encoder inputs)",
        tags=["vllm"],
    )
    async def vllm_generate(request: Request) -> JSONResponse:
        from schemas.validator import ValidationConfig, validate_features
        from schemas.vllm_wire import parse_generate_request

        st = state_of(request)
        tenant = tenant_of(request)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(
                415, "unsupported_media_type", "send application/json", rule="body.content_type"
            )
        body = await read_body(request, settings.api_max_body_bytes)
        try:
            obj = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad_request(f"body is not JSON: {e}", rule="body.json") from None

        def parse() -> tuple[Any, dict[str, Any]]:
            req = parse_generate_request(obj)
            if req.features is None:
                raise ValidationError("vllm.features", "a render response needs features")
            validate_features(
                req.token_ids,
                req.features,
                req.ec_transfer_params or {},
                ValidationConfig.from_settings(
                    settings, max_tensor_bytes=st.fanout.limits.max_tensor_bytes
                ),
            )
            # Embedding keys are the fan-out's to sign: a client naming its own would choose
            # where prefill reads from. So every item must bring its encoder inputs.
            for modality, index, _ in req.features.items():
                slot = (req.features.kwargs_data or {}).get(modality, [None] * (index + 1))
                if index >= len(slot) or slot[index] is None:
                    raise ValidationError(
                        "vllm.encoder_inputs_required",
                        "this endpoint fans out render responses: every item needs its "
                        "kwargs_data (ec_transfer_params are signed by the fan-out, not given)",
                        modality=modality,
                        item=index,
                    )
            return req, obj.get("sampling_params") or {}

        try:
            # Base64 + msgpack decoding of megabytes of tensors: off the event loop.
            req, sp = await asyncio.to_thread(parse)
        except ValidationError as exc:
            metrics.requests.labels("rejected").inc()
            raise from_validation(exc) from None
        max_tokens = sp.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 4096:
            raise ApiError(
                422,
                "validation_failed",
                "sampling_params.max_tokens must be an integer in [1, 4096]",
                rule="request.schema",
                field="sampling_params.max_tokens",
            )
        if sp.get("temperature", 0) not in (0, 0.0, None):
            raise ApiError(
                422,
                "validation_failed",
                "only greedy decoding (temperature 0) is supported",
                rule="sampling.temperature",
                field="sampling_params.temperature",
            )
        import hashlib

        # The body's meaning, not its formatting: key order and whitespace do not matter.
        canonical = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
        fingerprint = hashlib.sha256(canonical).hexdigest()

        async def render(rid: str) -> RenderEvent:
            return RenderEvent(
                request_id=rid,
                model=st.renderer.info.model_name,
                token_ids=list(req.token_ids),
                features=req.features,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                cache_salt=tenant_salt(tenant, req.cache_salt),
                trace={"vllm_request_id": str(req.request_id)} if req.request_id else {},
            )

        meta = {"vllm_request_id": str(req.request_id)} if req.request_id else None
        return await accept(
            st, request, tenant, fingerprint, render, metadata=meta, foreign_labels=True
        )

    # -------------------------------------------------------------------------- status

    @app.get(
        f"{API_PREFIX}/requests/{{request_id}}",
        response_model=RequestStatus,
        responses=ERROR_RESPONSES,
        summary="Status, stage timings and result; ?wait=SECONDS long-polls for a change",
        tags=["requests"],
    )
    async def get_status(
        request: Request,
        request_id: str,
        wait: float = Query(
            0.0,
            ge=0,
            le=3600,
            description="long-poll up to this many seconds until the status changes",
        ),
        changed_from: Status | None = Query(
            None,
            description="with wait: answer as soon as the status differs from this one (pass "
            "the last status you saw, so no change slips between two polls); without it, "
            "the long-poll waits for a change from the status the call finds",
        ),
    ) -> JSONResponse:
        st = state_of(request)
        tenant = tenant_of(request)
        rec = await owned_record(st, request_id, tenant)
        if wait > 0 and rec["status"] not in TERMINAL_STATUSES:
            timeout = min(wait, settings.api_max_wait_s)
            since = changed_from or rec["status"]
            rec = await st.notifier.wait_change(request_id, since, timeout) or rec
        return JSONResponse(observed(rec))

    @app.get(
        f"{API_PREFIX}/requests/{{request_id}}/events",
        responses=_with_errors(
            {
                200: {
                    "description": "Server-Sent Events: one `status` event per status change, "
                    "closing after the terminal one. Resume with `Last-Event-ID`.",
                    "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                }
            }
        ),
        summary="Server-Sent Events of every status change",
        tags=["requests"],
    )
    async def events(request: Request, request_id: str) -> StreamingResponse:
        st = state_of(request)
        tenant = tenant_of(request)
        await owned_record(st, request_id, tenant)
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        if last is not None and not is_stream_id(last):
            raise bad_request(
                "Last-Event-ID must be an id this API sent", rule="events.last_event_id"
            )
        return StreamingResponse(
            event_stream(st, request_id, last or "0"),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.delete(
        f"{API_PREFIX}/requests/{{request_id}}",
        response_model=RequestStatus,
        responses=ERROR_RESPONSES,
        summary="Cancel: status 'cancelled' at once; workers skip the request's work",
        tags=["requests"],
    )
    async def cancel(request: Request, request_id: str) -> JSONResponse:
        st = state_of(request)
        tenant = tenant_of(request)
        rec = await owned_record(st, request_id, tenant)
        if rec["status"] in TERMINAL_STATUSES and rec["status"] != "cancelled":
            raise ApiError(
                409,
                "already_finished",
                f"request is already {rec['status']}",
                rule="cancel.terminal",
            )
        await st.status.cancel(request_id)
        rec = await st.status.get(request_id) or rec
        if rec["status"] != "cancelled":  # it finished between the read and the cancel
            raise ApiError(
                409,
                "already_finished",
                f"request is already {rec['status']}",
                rule="cancel.terminal",
            )
        return JSONResponse(observed(rec))

    # ------------------------------------------------------------------ health, metrics

    @app.get("/healthz", response_model=Health, tags=["ops"], summary="process is up")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "checks": {}}

    @app.get(
        "/readyz",
        response_model=Health,
        responses={503: {"model": Health, "description": "a dependency is not ready"}},
        tags=["ops"],
        summary="Redis and the broker reachable, topics present",
    )
    async def readyz(request: Request) -> JSONResponse:
        st = state_of(request)
        checks: dict[str, Any] = {}
        try:
            await asyncio.wait_for(st.redis.ping(), 2.0)
            checks["redis"] = "ok"
        except Exception as e:
            checks["redis"] = f"error: {e}"
        checks["status_notifications"] = "ok" if st.notifier.healthy else "not subscribed"
        if not st.kafka_ready.is_set():
            checks["kafka"] = "not connected"
        else:
            try:
                producer = st.publisher.producer
                meta = await asyncio.wait_for(producer.client.fetch_all_metadata(), 3.0)
                missing = sorted(set(st.topics.all()) - set(meta.topics()))
                checks["kafka"] = "ok" if not missing else f"missing topics: {missing}"
            except Exception as e:
                checks["kafka"] = f"error: {e}"
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse(
            {"status": "ready" if ok else "not ready", "checks": checks},
            status_code=200 if ok else 503,
        )

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def prometheus(request: Request) -> Response:
        st = state_of(request)
        with contextlib.suppress(Exception):
            metrics.in_flight.set(await st.status.in_flight())
            counts = await st.status.in_flight_by_status()
            for status in ("queued", "encoding", "prefilling", "decoding"):
                metrics.by_status.labels(status).set(counts.get(status, 0))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    return app


def _with_errors(responses: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    return {**responses, **ERROR_RESPONSES}


def _deadline(inp: SubmitInput) -> int | None:
    return None if inp.deadline_s is None else now_ms() + int(inp.deadline_s * 1000)


def _error_info(code: str, message: str) -> Any:
    from schemas.types import ErrorInfo

    return ErrorInfo(code, message)
