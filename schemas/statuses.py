"""The request status vocabulary: one ``Literal``, every other spelling derived from it.

A request is *active* while it moves through the pipeline (the statuses in pipeline order: a
status record ranks them so) and *terminal* once it ended; the Avro ``epd.RequestStatus`` enum,
the API's OpenAPI schema and the Python client's ``TERMINAL`` are tied to these by tests. This
module imports nothing (not even torch), so light processes may read it.
"""

from __future__ import annotations

from typing import Literal, get_args

ActiveStatus = Literal["queued", "encoding", "prefilling", "decoding"]
"""A request on its way, in pipeline order."""
TerminalStatus = Literal["completed", "failed", "rejected", "expired", "cancelled"]
"""A request that ended."""
Status = Literal[ActiveStatus, TerminalStatus]
"""Every status a request can have."""

ACTIVE_STATUSES: tuple[ActiveStatus, ...] = get_args(ActiveStatus)
TERMINAL_STATUSES: frozenset[TerminalStatus] = frozenset(get_args(TerminalStatus))
STATUSES: tuple[Status, ...] = get_args(Status)
