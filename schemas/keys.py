"""Every Redis key and channel name of one pipeline, and the embedding store's key shapes.

One home, as :class:`schemas.topics.Topics` is for topics (and arq's ``constants.py`` for its
keys): the status records, their event streams and change channels, the in-flight set, cancel
flags, token streams and their channels, idempotency claims, the dead-letter replay ledger and
the store's readiness channels are named here and nowhere else.

On a Redis Cluster (``cluster=True``) every key of one request carries the hash tag
``{request_id}``: its record, event stream, cancel flag, token stream and change channels then
sit in one slot, so the record's compare-and-set script (which writes the record, appends to the
stream and announces the change) and a token write (append, expiry, announcement) each run on
one shard. A request id holding a brace (or none at all) would
give the request's keys different slots, so such an id is tagged by a digest of it instead. On a
single Redis the names are the ones this project always used (no braces), so an upgrade finds
the records written before it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def embedding_key(namespace: str, model_fingerprint: str, mm_hash: str) -> str:
    """Store key of one item's embeddings: ``{namespace}:{model_fingerprint}:{mm_hash}``."""
    return f"{namespace}:{model_fingerprint}:{mm_hash}"


def claim_key(namespace: str, mm_hash: str, field_name: str) -> str:
    """Store key of a claim-checked encoder input: ``{namespace}:claim:{mm_hash}:{field}``
    (``mm_hash``: the fan-out's own hash of the item).

    The fan-out writes it; the encode worker reads it and deletes it once the item's embedding is
    stored (and deletes nothing that is not exactly this key for the event's item).
    """
    return f"{namespace}:claim:{mm_hash}:{field_name}"


def kv_key(namespace: str, model_fingerprint: str, request_id: str) -> str:
    """Store key of a request's parked KV cache: ``{namespace}:kv:{model_fingerprint}:{id}``
    (no hash tag: one large entry, read and written alone, spread by its own hash)."""
    return f"{namespace}:kv:{model_fingerprint}:{request_id}"


def store_ready_channel(db: str) -> str:
    """The ``redis://`` store's readiness channel (pub/sub is global across DB numbers)."""
    return f"epd:store:ready:{db}"


def store_ready_slot_channel(channel: str, slot_tag: str) -> str:
    """The ``redis+cluster://`` store's sharded readiness channel of one slot (``slot_tag``
    hashes to that slot, so the channel sits beside the keys it announces)."""
    return f"{channel}:{{{slot_tag}}}"


def tagged_id(request_id: str) -> str:
    """The request id as cluster key names hold it: inside its hash tag (see the module docs)."""
    if request_id and "{" not in request_id and "}" not in request_id:
        return "{" + request_id + "}"
    return "{#" + hashlib.sha256(request_id.encode()).hexdigest()[:32] + "}" + request_id


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """The Redis names of one pipeline (``prefix``: its topic prefix)."""

    prefix: str = "epd"
    cluster: bool = False
    """Names for a Redis Cluster: a request's keys share its hash tag."""

    def _request(self, request_id: str) -> str:
        return tagged_id(request_id) if self.cluster else request_id

    def status(self, request_id: str) -> str:
        """The request's status record (JSON, with the record TTL)."""
        return f"{self.prefix}:status:{self._request(request_id)}"

    def status_events(self, request_id: str) -> str:
        """The stream of the request's status changes (Server-Sent Events replay it)."""
        return f"{self.prefix}:status-events:{self._request(request_id)}"

    @property
    def status_notify(self) -> str:
        """Single Redis: the one channel announcing every status change (message: the id)."""
        return f"{self.prefix}:status-notify"

    def status_changes(self, request_id: str) -> str:
        """Redis Cluster: the request's own sharded channel of changes (in its slot)."""
        return f"{self.prefix}:status-notify:{self._request(request_id)}"

    def tokens(self, request_id: str) -> str:
        """The stream of the request's tokens (:mod:`runtime.token_stream`)."""
        return f"{self.prefix}:tokens:{self._request(request_id)}"

    @property
    def tokens_notify(self) -> str:
        """Single Redis: the one channel announcing every token-stream write (message: the id)."""
        return f"{self.prefix}:tokens-notify"

    def token_changes(self, request_id: str) -> str:
        """Redis Cluster: the request's own sharded channel of token writes (in its slot)."""
        return f"{self.prefix}:tokens-notify:{self._request(request_id)}"

    @property
    def inflight(self) -> str:
        """The sorted set of unfinished requests (admission's bound, the sweep's worklist)."""
        return f"{self.prefix}:inflight"

    def cancel(self, request_id: str) -> str:
        """The flag that marks the request cancelled."""
        return f"{self.prefix}:cancel:{self._request(request_id)}"

    @property
    def cancel_channel(self) -> str:
        """The channel cancels are announced on (message: the id)."""
        return f"{self.prefix}:cancel"

    def idempotency(self, tenant: str | None, key_digest: str) -> str:
        """A tenant's ``Idempotency-Key`` claim (looked up by key, before any request id)."""
        return f"{self.prefix}:idem:{tenant or '-'}:{key_digest}"

    def dlq_replayed(self, topic: str, partition: int, offset: int, failed_ms: int) -> str:
        """The replay ledger's mark of one dead letter."""
        return f"{self.prefix}:dlq-replayed:{topic}:{partition}:{offset}:{failed_ms}"

    @property
    def fleet(self) -> str:
        """The hash of worker announcements (field: worker id; value: its JSON, which carries
        its own expiry): one key, so one read shows the whole fleet, on a cluster too."""
        return f"{self.prefix}:fleet"
