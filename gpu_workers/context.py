"""What every GPU worker is built from: one :class:`WorkerContext`.

The encode, prefill and decode workers take the same parts (the settings, the model, the
embedding store, the publisher, the topics, the worker's name, the cancel watch and the status
record writer); each worker adds only what is its own (a metrics registry, a request-state
reader, token streams). ``epd.stages.StageContext.worker_context`` builds one for a worker
process; tests build their own.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpu_workers.entries import worker_validation
from runtime.reporting import ResultReporter
from schemas.topics import Topics

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.publisher import Publisher
    from runtime.reporting import BatchStatusWriter, StatusWriter
    from runtime.settings import Settings
    from runtime.status import CancelWatch
    from runtime.stores.base import EmbeddingStore
    from schemas.types import ResultEvent
    from schemas.validator import ValidationConfig


class WorkerContext:
    """The parts a GPU worker shares with every other kind of GPU worker.

    ``topics``: the settings' prefix when not given. ``worker_id``: the name on the worker's
    status updates and logs (``{stage}@{host}`` when not given). ``cancel``: the request cancels
    the worker asks before and during its work. ``record`` (``StatusStore.apply``): every
    status update is also written to the request's status record directly (the results topic
    stays the durable record); ``record_all`` (``StatusStore.apply_all``): updates that
    queued up behind a slow one are written through in one go.
    """

    __slots__ = (
        "bundle",
        "cancel",
        "publisher",
        "record",
        "record_all",
        "settings",
        "store",
        "topics",
        "worker_id",
    )

    def __init__(
        self,
        settings: Settings,
        bundle: ModelBundle,
        store: EmbeddingStore,
        publisher: Publisher,
        *,
        topics: Topics | None = None,
        worker_id: str | None = None,
        cancel: CancelWatch | None = None,
        record: StatusWriter | None = None,
        record_all: BatchStatusWriter | None = None,
    ) -> None:
        self.settings = settings
        self.bundle = bundle
        self.store = store
        self.publisher = publisher
        self.topics = topics or Topics(settings.topic_prefix)
        self.worker_id = worker_id
        self.cancel = cancel
        self.record = record
        self.record_all = record_all

    def name(self, stage: str) -> str:
        """The worker's name as stage ``stage``."""
        return self.worker_id or f"{stage}@{socket.gethostname()}"

    def reporter(
        self, stage: str, *, on_gone: Callable[[ResultEvent], object] | None = None
    ) -> ResultReporter:
        """The worker's status updates to the results topic (and, with a record writer, the
        request's status record), as stage ``stage``."""
        return ResultReporter(
            self.publisher,
            self.topics.results,
            stage,
            self.name(stage),
            record=self.record,
            record_all=self.record_all,
            on_gone=on_gone,
        )

    def validation(self) -> ValidationConfig:
        """The worker's validation gate for its model and store (:func:`worker_validation`)."""
        return worker_validation(self.settings, self.bundle, self.store)
