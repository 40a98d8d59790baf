"""Request status in Redis: the record store, the in-flight set, notifications, cancels, and
what workers read of a request. The record's shape and fold are :mod:`schemas.status_record`
(pure); every Redis name is :class:`schemas.keys.RedisKeys`.

Modules: :mod:`~runtime.status.store` (records: compare-and-set updates, event streams),
:mod:`~runtime.status.inflight` (admission and the sweep's worklist),
:mod:`~runtime.status.listener` (a pub/sub subscription that survives reconnects),
:mod:`~runtime.status.notify` (status waiters),
:mod:`~runtime.status.cancel` (cancel flag and the workers' watch),
:mod:`~runtime.status.reader` (the workers' view of a request).
"""

from runtime.status.cancel import CancelWatch
from runtime.status.inflight import InFlight
from runtime.status.listener import ChannelListener
from runtime.status.notify import StatusNotifier
from runtime.status.reader import RequestReader, RequestState, RequestStateReader
from runtime.status.store import StatusGone, StatusStore

__all__ = [
    "CancelWatch",
    "ChannelListener",
    "InFlight",
    "RequestReader",
    "RequestState",
    "RequestStateReader",
    "StatusGone",
    "StatusNotifier",
    "StatusStore",
]
