"""Cancelling a request a client owns, for both cancel routes (``DELETE /v1/requests/{id}`` and
``POST /v1/responses/{id}/cancel``): a finished request is refused, a cancelled one answers its
status again."""

from __future__ import annotations

from frontend.api.errors import ApiError
from frontend.api.events import record_gone
from runtime.status import StatusStore
from schemas.status_record import StatusRecord


def refuse_finished(rec: StatusRecord) -> None:
    """409 ``cancel.terminal`` for a request that already has an outcome other than
    ``cancelled`` (cancelling a cancelled request answers its status again)."""
    if rec.terminal and rec.status != "cancelled":
        raise ApiError(
            409,
            "already_finished",
            f"request is already {rec.status}",
            rule="cancel.terminal",
        )


async def cancel_owned(status: StatusStore, rec: StatusRecord, shown_id: str) -> StatusRecord:
    """Cancel the caller's request ``rec`` and return its record after the cancel (409 for
    one that finished first, before or during the cancel; 404 ``record_gone`` naming
    ``shown_id`` for one whose record went meanwhile)."""
    refuse_finished(rec)
    await status.cancel(rec.request_id)
    after = await status.get(rec.request_id)
    if after is None:
        raise record_gone(shown_id)  # it went between the read and the cancel
    refuse_finished(after)  # it finished between the read and the cancel
    return after
