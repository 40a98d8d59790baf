"""Where the test suite's Kafka broker and Redis come from: one layer, three modes.

1. ``env``: ``EPD_KAFKA_BOOTSTRAP`` / ``EPD_REDIS_URL`` are set -> use them as they are (a staging
   Kafka, a cluster, services someone else runs). Nothing is started.
2. ``containers``: a Docker engine answers -> testcontainers: one broker container and one Redis
   container for the test session, removed at the end even after a failure. Images: the official
   ``apache/kafka`` (KRaft, single node) and ``redis:7``, or ``EPD_TC_KAFKA_IMAGE`` /
   ``EPD_TC_REDIS_IMAGE``; where no registry can be reached and the official images are not
   present, the ``FROM scratch`` images that ``docker/build-images.sh`` builds from binaries on
   this machine (Tansu, redis-server). Host networking, bound to 127.0.0.1.
3. ``embedded``: otherwise -> a Tansu broker and a redis-server as child processes (what
   ``epd services run`` does), on free ports, tied to the pytest process.
   ``EPD_TEST_KAFKA=apache`` makes the embedded broker a real Apache Kafka node run from Maven
   jars (:mod:`epd.apache_kafka`; the jars are resolved once into a cache, then a start takes
   seconds) instead of Tansu.

Transaction tests need a broker with transactions: :func:`transactional_kafka` gives the
session's broker when it is real Kafka, else starts one Apache Kafka node for the session (or
says why it cannot: no java/mvn, no Maven registry, no ``EPD_KAFKA_LIBS``).

``EPD_TEST_SERVICES=env|containers|embedded`` forces a mode; a forced mode that cannot start fails
loudly instead of falling back. Real Apache Kafka gets idempotent producers and the default
timings; the Tansu-only settings (no idempotence, short group timings, a short fetch wait) are
applied only when the broker is Tansu.

Faults (``ServiceHandle.pause``/``unpause``/``restart``) are done to what this layer started:
``docker pause``/``restart`` in container mode, SIGSTOP/SIGCONT and a restart of the process in
embedded mode; ``restart(down_s)`` keeps the service down (refusing connections) that long.
In ``env`` mode the services are not ours, so fault tests skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from epd import services

Mode = Literal["env", "containers", "embedded"]
MODES: tuple[Mode, ...] = ("env", "containers", "embedded")
ROOT = Path(__file__).resolve().parents[1]
BUILD_IMAGES = ROOT / "docker" / "build-images.sh"
OFFICIAL_KAFKA = "apache/kafka:3.9.1"
OFFICIAL_REDIS = "redis:7"
LABEL = "epd-tests"
READY_TIMEOUT_S = 90.0
PULL_TIMEOUT_S = 120.0

# testcontainers reads this when its config is first used: no reaper container (it would need a
# pull); this layer removes its containers itself, also those a killed run left behind.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")


class ServicesUnavailable(RuntimeError):
    """The requested (or forced) mode cannot provide the services."""


# ----------------------------------------------------------------------------- mode choice


def docker_client() -> Any | None:
    """A docker-py client whose daemon answers, else None."""
    try:
        import docker

        client = docker.from_env(timeout=10)
        client.ping()
        return client
    except Exception:
        return None


def choose_mode(environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[Mode, bool]:
    """(mode, forced). The order: forced, env vars, a Docker engine, embedded processes."""
    forced = environ.get("EPD_TEST_SERVICES", "").strip().lower()
    if forced:
        if forced not in MODES:
            raise ServicesUnavailable(
                f"EPD_TEST_SERVICES={forced!r}: choose one of {', '.join(MODES)}"
            )
        return forced, True  # type: ignore[return-value]
    if environ.get("EPD_KAFKA_BOOTSTRAP") or environ.get("EPD_REDIS_URL"):
        return "env", False
    if docker_client() is not None:
        return "containers", False
    return "embedded", False


# ----------------------------------------------------------------------------- images


def _image_present(client: Any, image: str) -> bool:
    try:
        client.images.get(image)
        return True
    except Exception:
        return False


def _try_pull(image: str) -> bool:
    """Pull ``image`` with a time limit (a closed network refuses at once; a slow one times out)."""
    try:
        proc = subprocess.run(
            ["docker", "pull", "-q", image],
            capture_output=True,
            timeout=PULL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def scratch_images(*, build: bool) -> dict[str, str]:
    """``{"tansu": ..., "redis": ...}`` from docker/build-images.sh (built when ``build``)."""
    env = {**os.environ, "PYTHON": sys.executable}
    args = ["bash", str(BUILD_IMAGES)] + ([] if build else ["--tags"])
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise ServicesUnavailable(f"docker/build-images.sh failed:\n{proc.stderr}")
    return dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)


@dataclass(frozen=True)
class Images:
    kafka: str
    redis: str
    kafka_is_tansu: bool
    source: str  # "override", "official" or "scratch"


def choose_images(client: Any, *, build: bool) -> Images:
    """The broker and Redis images for container mode (see the module docstring)."""
    kafka = os.environ.get("EPD_TC_KAFKA_IMAGE")
    redis = os.environ.get("EPD_TC_REDIS_IMAGE")
    if kafka or redis:
        kafka = kafka or OFFICIAL_KAFKA
        redis = redis or OFFICIAL_REDIS
        if build:
            for image in (kafka, redis):
                if not _image_present(client, image) and not _try_pull(image):
                    raise ServicesUnavailable(f"image {image} is neither present nor pullable")
        return Images(kafka, redis, "tansu" in kafka, "override")
    official = all(_image_present(client, i) for i in (OFFICIAL_KAFKA, OFFICIAL_REDIS))
    if not official and build:
        official = all(_image_present(client, i) or _try_pull(i) for i in (OFFICIAL_KAFKA,))
        official = official and (
            _image_present(client, OFFICIAL_REDIS) or _try_pull(OFFICIAL_REDIS)
        )
    if official:
        return Images(OFFICIAL_KAFKA, OFFICIAL_REDIS, False, "official")
    tags = scratch_images(build=build)
    return Images(tags["tansu"], tags["redis"], True, "scratch")


# ----------------------------------------------------------------------------- handles


@dataclass
class ServiceHandle:
    """One running service this layer may fault: pause/unpause/restart keep its address."""

    name: str
    address: str
    pause: Callable[[], None] | None = None
    unpause: Callable[[], None] | None = None
    restart: Callable[..., None] | None = None
    """``restart(down_s=0.0)``: stop it, keep it down ``down_s`` seconds, start it (empty)."""

    @property
    def controllable(self) -> bool:
        return self.pause is not None


@dataclass
class TestServices:
    """What a test session runs against."""

    __test__ = False  # not a test class, despite the name

    mode: Mode
    forced: bool
    kafka: ServiceHandle
    redis: ServiceHandle
    kafka_is_tansu: bool
    description: str
    env: dict[str, str]
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Stop and remove everything this layer started (reverse order, errors ignored)."""
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()


def settings_env(bootstrap: str, redis_url: str, *, tansu: bool) -> dict[str, str]:
    """EPD_* variables for these services: Tansu-only settings only for Tansu."""
    rec = services.ServiceRecord("kafka", bootstrap, False)
    env = services.services_env(rec, redis_url, tansu)
    if not tansu:
        env["EPD_KAFKA_IDEMPOTENCE"] = "true"  # real Kafka: idempotent producers on
    return env


# ----------------------------------------------------------------------------- env mode


def _from_env() -> TestServices:
    from runtime.settings import Settings

    s = Settings()
    if not services.kafka_answers(s.kafka_bootstrap):
        raise ServicesUnavailable(f"EPD_KAFKA_BOOTSTRAP={s.kafka_bootstrap} does not answer")
    if not services.redis_answers(s.redis_url):
        raise ServicesUnavailable(f"EPD_REDIS_URL={s.redis_url} does not answer PING")
    env = {k: v for k, v in os.environ.items() if k.startswith("EPD_KAFKA") or k == "EPD_REDIS_URL"}
    env.setdefault("EPD_KAFKA_BOOTSTRAP", s.kafka_bootstrap)
    env.setdefault("EPD_REDIS_URL", s.redis_url)
    return TestServices(
        mode="env",
        forced=False,
        kafka=ServiceHandle("kafka", s.kafka_bootstrap),
        redis=ServiceHandle("redis", s.redis_url),
        kafka_is_tansu=not s.kafka_idempotence,
        description=f"env (kafka={s.kafka_bootstrap}, redis={s.redis_url})",
        env=env,
    )


# ----------------------------------------------------------------------------- containers


def _remove_stale_containers(client: Any) -> None:
    """Containers a killed test run left behind (their owner pid is gone)."""
    for c in client.containers.list(all=True, filters={"label": LABEL}):
        owner = c.labels.get(LABEL, "")
        pid = int(owner) if owner.isdigit() else None
        if pid is None or not services.pid_alive(pid):
            with contextlib.suppress(Exception):
                c.remove(force=True)


def _start_container(
    image: str,
    *,
    command: list[str] | None,
    env: dict[str, str],
    ready: Callable[[], bool],
    closers: list[Callable[[], None]],
) -> Any:
    from testcontainers.core.container import DockerContainer

    container = (
        DockerContainer(image)
        .with_kwargs(network_mode="host", labels={LABEL: str(os.getpid())})
        .with_name(f"epd-test-{uuid.uuid4().hex[:10]}")
    )
    for k, v in env.items():
        container = container.with_env(k, v)
    if command:
        container = container.with_command(command)
    container.start()
    closers.append(container.stop)
    wrapped = container.get_wrapped_container()

    def alive() -> bool:
        wrapped.reload()
        return wrapped.status in ("created", "running", "restarting")

    if not services.wait_until(ready, READY_TIMEOUT_S, alive=alive):
        out, err = container.get_logs()
        raise ServicesUnavailable(f"{image} did not answer:\n{out.decode()}{err.decode()}")
    return wrapped


def _kafka_container_args(image: str, port: int, tansu: bool) -> tuple[list[str] | None, dict]:
    url = f"127.0.0.1:{port}"
    if tansu:
        listener = f"tcp://{url}"
        cmd = ["--listener-url", listener, "--advertised-listener-url", listener]
        return [*cmd, "--storage-engine", "memory://tansu/"], {}
    controller = services.free_port()
    return None, {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": f"PLAINTEXT://{url},CONTROLLER://127.0.0.1:{controller}",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{url}",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": f"1@127.0.0.1:{controller}",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_MESSAGE_MAX_BYTES": "16777216",
        "KAFKA_REPLICA_FETCH_MAX_BYTES": "16777216",
    }


def _container_handle(name: str, address: str, wrapped: Any, ready: Callable[[], bool]) -> Any:
    def restart(down_s: float = 0.0) -> None:
        if down_s > 0:
            wrapped.stop(timeout=5)
            time.sleep(down_s)
            wrapped.start()
        else:
            wrapped.restart(timeout=5)
        if not services.wait_until(ready, READY_TIMEOUT_S, alive=lambda: True):
            raise ServicesUnavailable(f"{name} did not come back after a restart")

    return ServiceHandle(name, address, wrapped.pause, wrapped.unpause, restart)


def _containers(forced: bool) -> TestServices:
    client = docker_client()
    if client is None:
        raise ServicesUnavailable("no Docker engine answers (docker/ensure-dockerd.sh starts one)")
    _remove_stale_containers(client)
    images = choose_images(client, build=True)
    closers: list[Callable[[], None]] = []
    try:
        kport = services.free_port()
        bootstrap = f"127.0.0.1:{kport}"
        cmd, kenv = _kafka_container_args(images.kafka, kport, images.kafka_is_tansu)

        def kafka_ready() -> bool:
            return services.kafka_answers(bootstrap, 2.0)

        kafka = _start_container(
            images.kafka, command=cmd, env=kenv, ready=kafka_ready, closers=closers
        )
        rport = services.free_port()
        redis_url = f"redis://127.0.0.1:{rport}/0"

        def redis_ready() -> bool:
            return services.redis_answers(redis_url)

        # Both images take server flags as the command (the official entrypoint prepends
        # redis-server to arguments that start with "-"; ours has it as the entrypoint).
        rcmd = ["--bind", "127.0.0.1", "--port", str(rport), "--save", "", "--appendonly", "no"]
        redis = _start_container(
            images.redis, command=rcmd, env={}, ready=redis_ready, closers=closers
        )
    except BaseException:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()
        raise
    return TestServices(
        mode="containers",
        forced=forced,
        kafka=_container_handle("kafka", bootstrap, kafka, kafka_ready),
        redis=_container_handle("redis", redis_url, redis, redis_ready),
        kafka_is_tansu=images.kafka_is_tansu,
        description=f"testcontainers (kafka={images.kafka}, redis={images.redis})",
        env=settings_env(bootstrap, redis_url, tansu=images.kafka_is_tansu),
        _closers=closers,
    )


# ----------------------------------------------------------------------------- embedded


def _process_handle(
    name: str, record: services.ServiceRecord, start: Callable[[], services.ServiceRecord]
) -> ServiceHandle:
    current = {"rec": record}

    def send(sig: int) -> None:
        pid = current["rec"].pid
        if pid is not None:
            os.kill(pid, sig)

    def restart(down_s: float = 0.0) -> None:
        old = current["rec"]
        services.stop_process(old.pid, old.command)
        time.sleep(down_s)
        current["rec"] = start()

    handle = ServiceHandle(
        name,
        record.address,
        lambda: send(signal.SIGSTOP),
        lambda: send(signal.SIGCONT),
        restart,
    )
    handle._current = current  # type: ignore[attr-defined]
    return handle


def test_broker_kind() -> str:
    """The embedded broker: ``$EPD_TEST_KAFKA`` (``tansu`` by default, or ``apache``)."""
    kind = (os.environ.get("EPD_TEST_KAFKA") or "tansu").strip().lower()
    if kind not in services.BROKERS:
        raise ServicesUnavailable(
            f"EPD_TEST_KAFKA={kind!r}: choose one of {', '.join(services.BROKERS)}"
        )
    return kind


def _embedded(forced: bool, log_dir: Path) -> TestServices:
    log_dir.mkdir(parents=True, exist_ok=True)
    closers: list[Callable[[], None]] = []

    def stop(rec_holder: dict[str, services.ServiceRecord]) -> Callable[[], None]:
        return lambda: services.stop_records([rec_holder["rec"]])

    kind = test_broker_kind()
    try:
        kafka_rec = services.start_broker(kind, log_dir, log_dir=log_dir, tie_to_parent=True)
        port = int(kafka_rec.address.rsplit(":", 1)[1])

        def start_kafka() -> services.ServiceRecord:
            return services.start_broker(
                kind, log_dir, port=port, log_dir=log_dir, tie_to_parent=True
            )

        kafka = _process_handle("kafka", kafka_rec, start_kafka)
        closers.append(stop(kafka._current))  # type: ignore[attr-defined]
        if shutil.which("redis-server"):
            url = f"redis://127.0.0.1:{services.free_port()}/0"
            redis_rec = services.start_redis(log_dir, url, log_dir=log_dir, tie_to_parent=True)

            def start_redis() -> services.ServiceRecord:
                return services.start_redis(
                    log_dir, redis_rec.address, log_dir=log_dir, tie_to_parent=True
                )

            redis = _process_handle("redis", redis_rec, start_redis)
            closers.append(stop(redis._current))  # type: ignore[attr-defined]
            redis_desc = "redis-server"
        else:  # no redis-server to start: a Redis that already answers, not ours to fault
            url = os.environ.get("EPD_REDIS_URL") or services.DEFAULT_REDIS_URL
            if not services.redis_answers(url):
                raise ServicesUnavailable(services.REDIS_INSTALL_HINT)
            redis = ServiceHandle("redis", url)
            redis_desc = f"reused {url}"
    except BaseException:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()
        raise
    return TestServices(
        mode="embedded",
        forced=forced,
        kafka=kafka,
        redis=redis,
        kafka_is_tansu=kind == "tansu",
        description=f"embedded (kafka={kind} process, redis={redis_desc})",
        env=settings_env(kafka.address, redis.address, tansu=kind == "tansu"),
        _closers=closers,
    )


# ----------------------------------------------------------------------------- entry points


def describe_planned() -> str:
    """The header line, decided without starting anything (images by name)."""
    try:
        mode, forced = choose_mode()
    except ServicesUnavailable as exc:
        return f"services: error ({exc})"
    how = "forced by EPD_TEST_SERVICES" if forced else "auto"
    if mode == "env":
        kafka = os.environ.get("EPD_KAFKA_BOOTSTRAP", "default")
        redis = os.environ.get("EPD_REDIS_URL", "default")
        return f"services: env (kafka={kafka}, redis={redis}; {how})"
    if mode == "containers":
        client = docker_client()
        if client is None:
            return f"services: testcontainers (no Docker engine answers; {how})"
        try:
            images = choose_images(client, build=False)
        except ServicesUnavailable as exc:
            return f"services: testcontainers (images unavailable: {exc})"
        return f"services: testcontainers (kafka={images.kafka}, redis={images.redis}; {how})"
    broker = "Apache Kafka" if os.environ.get("EPD_TEST_KAFKA") == "apache" else "Tansu"
    return f"services: embedded ({broker} and redis-server processes; {how})"


def provide(log_dir: Path) -> TestServices:
    """Start (or point at) the services for this session, by the rules in the module docstring."""
    mode, forced = choose_mode()
    t0 = time.monotonic()
    if mode == "env":
        ts = _from_env()
        ts.forced = forced
    elif mode == "containers":
        ts = _containers(forced)
    else:
        ts = _embedded(forced, log_dir)
    ts.description += f"; ready in {time.monotonic() - t0:.1f}s"
    return ts


# ----------------------------------------------------------------------------- transactions


@dataclass
class TransactionalKafka:
    """A broker with transactions for this session: the session's own or one started for it."""

    bootstrap: str
    description: str
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()


def transactional_kafka(session: TestServices, log_dir: Path) -> TransactionalKafka:
    """The session's broker when it is real Kafka; else a new Apache Kafka node (from jars).

    Raises :class:`ServicesUnavailable` saying why no such broker can be had here.
    """
    if not session.kafka_is_tansu:
        return TransactionalKafka(session.kafka.address, f"session broker ({session.mode})")
    t0 = time.monotonic()
    try:
        rec = services.start_apache_kafka(log_dir, log_dir=log_dir, tie_to_parent=True)
    except services.ServiceError as exc:
        raise ServicesUnavailable(f"no broker with transactions: {exc}") from exc
    return TransactionalKafka(
        rec.address,
        f"Apache Kafka from jars, ready in {time.monotonic() - t0:.1f}s",
        [lambda: services.stop_records([rec])],
    )
