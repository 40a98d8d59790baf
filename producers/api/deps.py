"""What routes take through FastAPI dependencies: the shared state, the caller's tenant (from
the bearer token, also declared as the OpenAPI security scheme) and the records it owns."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from producers.api.errors import not_found
from producers.api.state import ApiState

bearer = HTTPBearer(
    auto_error=False,
    description="a token of EPD_API_TOKENS (`Authorization: Bearer TOKEN`); an API started "
    "without tokens ignores it",
)


def api_state(request: Request) -> ApiState:
    """The app's :class:`ApiState` (made in the lifespan)."""
    st: ApiState = request.app.state.api
    return st


State = Annotated[ApiState, Depends(api_state)]


def caller_tenant(
    st: State, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str | None:
    """The caller's tenant (None on an open API); 401 for a missing or unknown token."""
    return st.tenants.identify(credentials.credentials if credentials else None)


Tenant = Annotated[str | None, Depends(caller_tenant)]


async def owned_record(request_id: str, st: State, tenant: Tenant) -> dict[str, Any]:
    """The caller's record of ``request_id``. Another tenant's request is "not found", not
    "forbidden": ids reveal nothing."""
    rec = await st.status.get(request_id)
    if rec is None or rec.get("tenant") != tenant:
        raise not_found(request_id)
    return rec


OwnedRecord = Annotated[dict[str, Any], Depends(owned_record)]
