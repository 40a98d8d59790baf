"""Requests decoding here whose status record went: they stop at their next step.

A write (a status update, a token) that finds the request's status record gone tells
:meth:`RecordWatch.on_gone`. No one can read that request's outcome through the API any more
(the record is never made again), so a request still decoding here stops, as a cancel would;
unless Redis itself restarted (or a cluster's master failed over) since the request was made, or
the record was not there yet when the request was admitted here: then the outcome still goes to
the results topic, as the README's failure modes say of a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.status import RequestState, RequestStateReader
    from schemas.types import ResultEvent

log = logging.getLogger(__name__)


class RecordWatch:
    """Which of a worker's decoding requests lost their status record."""

    RESTART_SLACK_MS = 2000
    """How early ``RequestState.records_since_ms`` may err (Redis's uptime is whole seconds)."""
    UNMADE_KEPT = 4096
    """Requests remembered as admitted without a record (the oldest forgotten first)."""

    def __init__(self, request_state: RequestStateReader | None, worker_id: str) -> None:
        """``request_state`` None (a worker that reads no records): nothing is ever judged gone."""
        self.request_state = request_state
        self.worker_id = worker_id
        self.decoding: dict[str, int] = {}
        """Requests in the worker's batch -> their creation time (epoch ms)."""
        self.gone: set[str] = set()
        """Requests in the batch whose status record went: stopped at the next step."""
        self._unmade: OrderedDict[str, None] = OrderedDict()
        """Requests admitted while they had no record: a record that was never seen cannot be
        judged gone (the write that makes it may be on the results topic, behind an outage)."""
        self._judging: set[asyncio.Task[None]] = set()

    @property
    def reads_records(self) -> bool:
        """Whether the worker reads status records (and so can tell one went)."""
        return self.request_state is not None

    def admitted(self, request_id: str, state: RequestState | None) -> None:
        """What the admission read found of ``request_id``'s record (None: Redis unreadable)."""
        if state is not None and state.status is None:
            self._unmade[request_id] = None
            if len(self._unmade) > self.UNMADE_KEPT:
                self._unmade.popitem(last=False)
        else:
            self._unmade.pop(request_id, None)

    def track(self, request_id: str, created_ms: int) -> None:
        """``request_id`` decodes here from now on."""
        self.decoding[request_id] = created_ms

    def untrack(self, request_id: str) -> bool:
        """``request_id`` decodes here no more: whether its record had gone."""
        self.decoding.pop(request_id, None)
        self._unmade.pop(request_id, None)
        went = request_id in self.gone
        self.gone.discard(request_id)
        return went

    def on_gone_event(self, event: ResultEvent) -> None:
        """:meth:`on_gone` for the status update that found the record gone."""
        self.on_gone(event.request_id)

    def on_gone(self, request_id: str) -> None:
        """A write found ``request_id``'s status record gone: judge (in the background)
        whether it stops."""
        created = self.decoding.get(request_id)
        if created is None or request_id in self.gone or self.request_state is None:
            return
        task = asyncio.get_running_loop().create_task(self._judge(request_id, created))
        self._judging.add(task)
        task.add_done_callback(self._judging.discard)

    async def _judge(self, request_id: str, created_ms: int) -> None:
        assert self.request_state is not None
        state = await self.request_state(request_id, since=True)
        since = state.records_since_ms if state is not None else None
        if state is None or state.status is not None or since is None:
            return  # cannot tell, or it is there (again): go on
        if request_id in self._unmade:
            log.info(
                "%s: %s has no record yet (none when it was admitted: its first write may be "
                "on the results topic); going on",
                self.worker_id,
                request_id,
            )
            return
        if since + self.RESTART_SLACK_MS >= created_ms:
            log.info(
                "%s: %s lost its record with a Redis restart; going on", self.worker_id, request_id
            )
            return
        if request_id in self.decoding:
            self.gone.add(request_id)
            log.warning(
                "%s: the status record of %s went while it decoded (its TTL, an eviction, an "
                "operator); it stops",
                self.worker_id,
                request_id,
            )

    async def close(self) -> None:
        """Stop the judgements still under way."""
        for task in list(self._judging):
            task.cancel()
