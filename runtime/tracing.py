"""Trace context that follows a request from submit to result: W3C ``traceparent`` + OpenTelemetry.

A request gets a ``traceparent`` when it is submitted (the API takes a caller's, the Submitter
makes one); it travels in the event's ``trace`` map (durable, copied by the fan-out) and as a
Kafka header. Each stage opens a span named after itself as a child of that context
(:func:`stage_span`), so with an OpenTelemetry SDK configured the stages show up as one trace;
without one (the default) the no-op tracer still carries the context through, which is all the
logs and result records need. Exporting is the deployment's choice.

The request id and trace id of the record being handled sit in context variables, so every log
line written while handling it carries them (:mod:`runtime.logs`).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER = trace.get_tracer("epd-pipeline")

request_id_var: ContextVar[str | None] = ContextVar("epd_request_id", default=None)
"""The request being handled in this task, for log lines."""

produced_ms_var: ContextVar[int | None] = ContextVar("epd_produced_ms", default=None)
"""When the record being handled in this task was produced (its Kafka timestamp, wall-clock
ms), so a stage can time the broker hop it came through (:func:`broker_hop_ms`)."""


def new_traceparent() -> str:
    """A fresh W3C ``traceparent`` (version 00, sampled) for a request that arrives without one."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def trace_id_of(traceparent: str | None) -> str | None:
    """The 32-hex trace id of a ``traceparent``, or None when it is missing or malformed."""
    if not traceparent:
        return None
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1].lower()


def current_carrier() -> dict[str, str]:
    """The active trace context as W3C headers (empty when there is none)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def current_trace_id() -> str | None:
    """The trace id of the active span, or None outside any traced request."""
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


@contextlib.contextmanager
def stage_span(
    stage: str,
    carrier: Mapping[str, str],
    *,
    request_id: str | None = None,
    produced_ms: int | None = None,
) -> Iterator[None]:
    """Run the body as span ``stage``, a child of the context in ``carrier`` (W3C headers),
    with ``request_id`` set for log lines and ``produced_ms`` (the consumed record's timestamp)
    for :func:`broker_hop_ms`."""
    token = otel_context.attach(_PROPAGATOR.extract(dict(carrier)))
    rid = request_id_var.set(request_id)
    produced = produced_ms_var.set(produced_ms)
    try:
        with _TRACER.start_as_current_span(stage) as span:
            if request_id is not None:
                span.set_attribute("epd.request_id", request_id)
            yield
    finally:
        produced_ms_var.reset(produced)
        request_id_var.reset(rid)
        otel_context.detach(token)


def broker_hop_ms(now_ms: int) -> float | None:
    """Milliseconds from the handled record's production to ``now_ms`` (None outside a consumed
    record, or for a record without a timestamp). Kafka stamps whole ms, so this is +-1 ms."""
    produced = produced_ms_var.get()
    if produced is None or produced < 0:
        return None
    return float(max(0, now_ms - produced))


def carrier_of(trace_map: Mapping[str, str] | None, headers: Mapping[str, bytes]) -> dict[str, str]:
    """The W3C carrier of a consumed record: its event's ``trace`` map, else its Kafka header."""
    carrier = {k: v for k, v in (trace_map or {}).items() if isinstance(v, str)}
    if TRACEPARENT not in carrier and TRACEPARENT in headers:
        carrier[TRACEPARENT] = headers[TRACEPARENT].decode("ascii", "replace")
    return carrier
