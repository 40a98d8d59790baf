"""``GET /v1/admin/fleet``: the fleet view for tools (what ``epd status --json`` prints)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.security import HTTPAuthorizationCredentials

from frontend.api.deps import State, bearer

router = APIRouter(tags=["admin"])


async def caller_admin(
    st: State, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """Admits a caller with an admin token (``EPD_ADMIN_TOKENS``), or anyone on an open API
    without admin tokens; 401/403 with rule ``auth.admin`` otherwise."""
    st.admins.check(credentials.credentials if credentials else None)


@router.get(
    "/v1/admin/fleet",
    summary="the fleet: live workers per stage, lag per group and partition, dead letters, "
    "unfinished requests by status, store memory, and what keeps the pipeline from serving",
    dependencies=[Depends(caller_admin)],
    responses={401: {"description": "no admin token"}, 403: {"description": "not an admin"}},
)
async def fleet(
    st: State,
    kafka: Annotated[
        bool, Query(description="also read the broker's offsets (lag, dead letters)")
    ] = True,
) -> dict[str, Any]:
    snap = await (st.fleet.recent() if kafka else st.fleet.snapshot(kafka=False))
    return snap.to_dict()
