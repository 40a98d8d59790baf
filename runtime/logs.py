"""Worker logging: one JSON object per line, with the request id and trace id of the request
being handled (from :mod:`runtime.tracing`'s context), so ``grep <request_id>`` over every
stage's logs finds the whole story of one request."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from runtime.tracing import current_trace_id, request_id_var

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "request_id"?, "trace_id"?, ...extra}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        tid = getattr(record, "trace_id", None) or current_trace_id()
        if tid:
            out["trace_id"] = tid
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class ContextFilter(logging.Filter):
    """Adds ``request_id``/``trace_id`` attributes for text formats (``%(request_id)s``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = getattr(record, "request_id", None) or request_id_var.get() or "-"
        record.trace_id = getattr(record, "trace_id", None) or current_trace_id() or "-"
        return True


def configure_logging(level: str, fmt: str = "json") -> None:
    """Root logging for a worker process: JSON lines (default) or text, on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(ContextFilter())
        handler.setFormatter(
            logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s [%(request_id)s %(trace_id)s]: %(message)s"
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
