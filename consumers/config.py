"""What one consume loop reads and how hard it tries (:class:`ConsumerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from consumers.retry import RetryPolicy

__all__ = ["ConsumerConfig"]


@dataclass(slots=True)
class ConsumerConfig:
    """What one consume loop reads and how hard it tries."""

    topics: list[str]
    group_id: str
    dlq_topic: str
    max_in_flight: int = 64
    max_attempts: int = 3
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    transient_retry_s: float = 30.0
    """Time budget for store/broker outages (retried however many tries it takes)."""
    transient_backoff_max_s: float = 2.0
    """Longest pause between tries during an outage: work resumes this soon after it ends."""
    commit_interval_s: float = 0.5
    commit_timeout_s: float = 10.0
    """Bound on one commit (and on closing the clients): a dead coordinator must not hang us."""
    shutdown_timeout_s: float = 30.0
    revoke_timeout_s: float = 10.0
    poll_timeout_ms: int = 200
    """Longest one poll waits while handlers run or offsets wait to be committed."""
    idle_poll_timeout_ms: int = 1000
    """Longest one poll waits with nothing owed (a record, a stop or a freed slot end it at
    once): an idle loop wakes this often, to look for a lost log (:mod:`consumers.idle`)."""
    consumer_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra ``AIOKafkaConsumer`` arguments (session timeouts, client id, ...)."""

    def __post_init__(self) -> None:
        if not self.topics:
            raise ValueError("ConsumerConfig.topics must name at least one topic")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.transient_retry_s < 0:
            raise ValueError(f"transient_retry_s must be >= 0, got {self.transient_retry_s}")

    def retry_policy(self) -> RetryPolicy:
        """The retry budget these settings describe."""
        return RetryPolicy(
            max_attempts=self.max_attempts,
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
            transient_retry_s=self.transient_retry_s,
            transient_backoff_max_s=self.transient_backoff_max_s,
        )
