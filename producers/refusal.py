"""Why the intake turned a request away, in words every front can translate.

The intake (:mod:`producers.intake`) is shared by the HTTP API, the in-process ``Submitter``
and any later front (OpenAI-compatible routes), so it cannot speak HTTP. It raises
``schemas.errors.ValidationError`` for an input that breaks a rule, and :class:`Refused` for
everything else it declines; each front maps the ``kind`` to its own answer (the native API:
400/409/429/503 in ``frontend.api.errors``).
"""

from __future__ import annotations

from typing import Literal

RefusalKind = Literal["malformed", "conflict", "throttled", "unavailable"]


class Refused(Exception):
    """A request the intake declined, with nothing of it left behind (no record, no work).

    ``kind``: ``malformed`` (the request cannot be taken as given), ``conflict`` (it clashes
    with an earlier one, e.g. an ``Idempotency-Key`` reused with another body), ``throttled``
    (too much in flight; retry after ``retry_after_s``), ``unavailable`` (a dependency is down;
    retry after ``retry_after_s``).
    """

    def __init__(
        self,
        kind: RefusalKind,
        message: str,
        *,
        rule: str,
        field: str | None = None,
        retry_after_s: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: RefusalKind = kind
        self.message = message
        self.rule = rule
        self.field = field
        self.retry_after_s = retry_after_s
        self.code = code
        """A more precise code than the kind's (``idempotency_conflict``)."""
