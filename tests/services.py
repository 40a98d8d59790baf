"""Where the test suite's Kafka broker and Redis come from: one layer, three modes, two brokers.

Modes (``EPD_TEST_SERVICES=env|containers|embedded`` forces one; a forced mode that cannot start
fails loudly instead of falling back):

1. ``env``: ``EPD_KAFKA_BOOTSTRAP`` / ``EPD_REDIS_URL`` are set -> use them as they are (a staging
   Kafka, a cluster, services someone else runs). Nothing is started; fault tests skip.
2. ``containers``: a Docker engine answers -> testcontainers: one broker container and one Redis
   container for the test session, removed at the end even after a failure. Host networking,
   bound to 127.0.0.1. The images are built ``FROM scratch`` from this machine's files by
   ``docker/build-images.sh`` (no registry needed): ``epd-kafka`` (a jlink'd Java runtime of the
   machine's JDK and the cached Apache Kafka jars), ``epd-tansu`` (the Tansu binary) and
   ``epd-redis`` (redis-server); ``redis:7`` is used when present. ``EPD_TC_KAFKA_IMAGE`` /
   ``EPD_TC_REDIS_IMAGE`` name others (a Kafka image that is not ours is configured as the
   official ``apache/kafka`` one is, through ``KAFKA_*`` variables).
3. ``embedded``: otherwise -> the broker and a redis-server as child processes on free ports,
   tied to the pytest process (what ``epd services run`` does).

The broker, in containers and embedded mode: ``EPD_TEST_BROKER=apache|tansu|auto`` (default
``auto``: Apache Kafka 4.4 when Java 17+ and its jars, or ``mvn`` to fetch them, are here, else
Tansu, and the pytest header says why). Real Apache Kafka gets idempotent producers and the
default timings; the Tansu-only settings (no idempotence, short group timings, a short fetch
wait) are applied only to Tansu.

Faults (``ServiceHandle.pause``/``unpause``/``restart``) are done to what this layer started:
``docker pause``/``kill``/``restart`` in container mode, signals and a new process in embedded
mode. ``restart(down_s, hard=...)`` keeps the service down that long; ``hard`` is a SIGKILL
instead of a clean stop. What comes back: Apache Kafka with its log directory (topics, records,
committed offsets), Tansu and Redis empty.

Transaction tests need a broker with transactions: :func:`transactional_kafka` gives the
session's broker when it is Apache Kafka, else starts one Apache Kafka node for the session (or
says why it cannot).

Parallel runs (``pytest -n N``, what ``make test`` runs): every xdist worker is a pytest session
of its own, so each starts its own broker and Redis (and, when its tests ask, its own Redis
Cluster and transactional broker) on free ports, and a fault a test does to them reaches no
other worker's tests. What several processes would otherwise build or fetch at once (the
scratch images, Apache Kafka's jars) is done under :func:`machine_lock`, by the first of them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from epd import services
from epd.services import kafka as apache
from epd.services import kafka_image

Mode = Literal["env", "containers", "embedded"]
MODES: tuple[Mode, ...] = ("env", "containers", "embedded")
BROKER_CHOICES = ("auto", "apache", "tansu")
ROOT = Path(__file__).resolve().parents[1]
BUILD_IMAGES = ROOT / "docker" / "build-images.sh"
OFFICIAL_REDIS = "redis:7"
LABEL = "epd-tests"
READY_TIMEOUT_S = 90.0
DATA_DIR_IN_IMAGE = kafka_image.IMAGE_LOG_DIR

# testcontainers reads this when its config is first used: no reaper container (it would need a
# pull); this layer removes its containers itself, also those a killed run left behind.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")


class ServicesUnavailable(RuntimeError):
    """The requested (or forced) mode or broker cannot provide the services."""


@contextlib.contextmanager
def machine_lock(name: str = "prepare") -> Iterator[None]:
    """Held by one process of this machine at a time (xdist workers, runs side by side): what
    writes files that every run shares (images, the jar cache) runs under it, so that two
    first runs do not build the same image or replace the jar directory under each other."""
    import fcntl

    with open(Path(tempfile.gettempdir()) / f"epd-tests-{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _jars_ready() -> None:
    """Apache Kafka's jars resolved (fetched by the first process that needs them)."""
    with machine_lock():
        apache.resolve_jars()


# ----------------------------------------------------------------------------- choices


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


def choose_broker(environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, str]:
    """``(kind, how)`` from ``EPD_TEST_BROKER``: ``how`` says whether it was asked for or, under
    ``auto``, why Apache Kafka could not be had. A broker asked for that cannot run is an error."""
    raw = (environ.get("EPD_TEST_BROKER") or "auto").strip().lower()
    if raw not in BROKER_CHOICES:
        raise ServicesUnavailable(
            f"EPD_TEST_BROKER={raw!r}: choose one of {', '.join(BROKER_CHOICES)}"
        )
    if raw == "tansu":
        return "tansu", "EPD_TEST_BROKER=tansu"
    reason = apache.unavailable_reason()
    if raw == "apache":
        if reason:
            raise ServicesUnavailable(f"EPD_TEST_BROKER=apache: {reason}")
        return "apache", "EPD_TEST_BROKER=apache"
    return ("tansu", f"auto; {reason}") if reason else ("apache", "auto")


# ----------------------------------------------------------------------------- images


def _image_present(client: Any, image: str) -> bool:
    try:
        client.images.get(image)
        return True
    except Exception:
        return False


def scratch_images(names: list[str], *, build: bool) -> dict[str, str]:
    """``{name: image}`` for ``names`` (kafka, tansu, redis) from docker/build-images.sh (built
    when ``build`` and missing)."""
    env = {**os.environ, "PYTHON": sys.executable}
    args = ["bash", str(BUILD_IMAGES), *([] if build else ["--tags"]), *names]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise ServicesUnavailable(f"docker/build-images.sh failed:\n{proc.stderr}")
    return dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)


@dataclass(frozen=True)
class Images:
    kafka: str
    redis: str
    broker: str  # "apache" or "tansu"

    @property
    def kafka_is_ours(self) -> bool:
        """Built by build-images.sh (configured by arguments, not ``KAFKA_*`` variables)."""
        return self.kafka.startswith(("epd-kafka:", "epd-tansu:"))


def choose_images(client: Any, broker: str, *, build: bool) -> Images:
    """The broker and Redis images for container mode (see the module docstring)."""
    kafka = os.environ.get("EPD_TC_KAFKA_IMAGE")
    redis = os.environ.get("EPD_TC_REDIS_IMAGE")
    if redis is None and _image_present(client, OFFICIAL_REDIS):
        redis = OFFICIAL_REDIS
    broker_image = "kafka" if broker == "apache" else "tansu"
    names = ([] if kafka else [broker_image]) + ([] if redis else ["redis"])
    built = scratch_images(names, build=build) if names else {}
    kafka = kafka or built[broker_image]
    redis = redis or built["redis"]
    for image in (kafka, redis):
        if build and not _image_present(client, image):
            raise ServicesUnavailable(f"image {image} is not present (and nothing is pulled)")
    return Images(kafka, redis, broker)


# ----------------------------------------------------------------------------- handles


@dataclass
class ServiceHandle:
    """One running service this layer may fault: pause/unpause/restart keep its address."""

    name: str
    address: str
    pause: Callable[[], None] | None = None
    unpause: Callable[[], None] | None = None
    restart: Callable[..., None] | None = None
    """``restart(down_s=0.0, hard=False)``: stop it (``hard``: SIGKILL), keep it down
    ``down_s`` seconds, start it again on the same address (and, for Apache Kafka, the same
    log directory)."""

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
    broker: str
    """``apache``, ``tansu``, or ``external`` (env mode: not ours to know)."""
    description: str
    env: dict[str, str]
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def kafka_is_tansu(self) -> bool:
        return self.broker == "tansu"

    def close(self) -> None:
        """Stop and remove everything this layer started (reverse order, errors ignored)."""
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()


def settings_env(bootstrap: str, redis_url: str, *, tansu: bool) -> dict[str, str]:
    """EPD_* variables for these services: Tansu-only settings only for Tansu."""
    rec = services.ServiceRecord("kafka", bootstrap, False)
    env = services.services_env(rec, redis_url, "tansu" if tansu else "apache")
    if not tansu:
        env["EPD_KAFKA_IDEMPOTENCE"] = "true"  # real Kafka: idempotent producers on
    return env


def _broker_name(broker: str) -> str:
    return services.describe(broker)


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
        broker="tansu" if not s.kafka_idempotence else "external",
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


def _kafka_container_args(images: Images, port: int) -> tuple[list[str] | None, dict[str, str]]:
    """The broker container's command and environment."""
    from runtime.settings import Settings

    url = f"127.0.0.1:{port}"
    if images.broker == "tansu":
        listener = f"tcp://{url}"
        cmd = ["--listener-url", listener, "--advertised-listener-url", listener]
        return [*cmd, "--storage-engine", "memory://tansu/"], {}
    settings = Settings()
    props = apache.server_properties(
        port=port,
        controller_port=services.free_port(),
        log_dir=DATA_DIR_IN_IMAGE,
        max_message_bytes=settings.max_message_bytes,
        partitions=settings.topic_partitions,
    )
    if images.kafka_is_ours:
        env = {"CLUSTER_ID": apache.cluster_id(), "JAVA_OPTS": kafka_image.container_options()}
        return [f"{k}={v}" for k, v in props.items()], env
    # An official-style image: every property as KAFKA_<NAME> (dots -> underscores, upper case).
    env = {"KAFKA_" + k.replace(".", "_").upper(): v for k, v in props.items()}
    env["CLUSTER_ID"] = apache.cluster_id()
    return None, env


def _container_handle(name: str, address: str, wrapped: Any, ready: Callable[[], bool]) -> Any:
    def restart(down_s: float = 0.0, hard: bool = False) -> None:
        if hard:
            wrapped.kill(signal="SIGKILL")
        else:
            wrapped.stop(timeout=10)
        time.sleep(down_s)
        wrapped.start()
        if not services.wait_until(ready, READY_TIMEOUT_S, alive=lambda: True):
            raise ServicesUnavailable(f"{name} did not come back after a restart")

    return ServiceHandle(name, address, wrapped.pause, wrapped.unpause, restart)


def _containers(forced: bool) -> TestServices:
    client = docker_client()
    if client is None:
        raise ServicesUnavailable("no Docker engine answers (docker/ensure-dockerd.sh starts one)")
    _remove_stale_containers(client)
    broker, how = choose_broker()
    with machine_lock():
        images = choose_images(client, broker, build=True)
    closers: list[Callable[[], None]] = []
    try:
        kport = services.free_port()
        bootstrap = f"127.0.0.1:{kport}"
        cmd, kenv = _kafka_container_args(images, kport)

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
        broker=broker,
        description=(
            f"testcontainers (kafka={_broker_name(broker)} [{images.kafka}; {how}], "
            f"redis={images.redis})"
        ),
        env=settings_env(bootstrap, redis_url, tansu=broker == "tansu"),
        _closers=closers,
    )


# ----------------------------------------------------------------------------- embedded


def _process_handle(
    name: str, record: services.ServiceRecord, start: Callable[[], services.ServiceRecord]
) -> tuple[ServiceHandle, Callable[[], None]]:
    """A handle that faults the process behind ``record`` and the closer that stops it."""
    current = {"rec": record}

    def send(sig: int) -> None:
        pid = current["rec"].pid
        if pid is not None:
            os.kill(pid, sig)

    def restart(down_s: float = 0.0, hard: bool = False) -> None:
        old = current["rec"]
        if hard and old.pid is not None:
            os.kill(old.pid, signal.SIGKILL)
        services.stop_process(old.pid, old.command)  # reaps it (and ends it, if not hard)
        time.sleep(down_s)
        current["rec"] = start()

    handle = ServiceHandle(
        name,
        record.address,
        lambda: send(signal.SIGSTOP),
        lambda: send(signal.SIGCONT),
        restart,
    )

    def close() -> None:
        with contextlib.suppress(Exception):
            send(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
        services.stop_records([current["rec"]])

    return handle, close


def _embedded(forced: bool, log_dir: Path) -> TestServices:
    log_dir.mkdir(parents=True, exist_ok=True)
    closers: list[Callable[[], None]] = []
    broker, how = choose_broker()
    try:
        if broker == "apache":
            _jars_ready()
        kafka_rec = services.start_broker(
            broker, log_dir, log_dir=log_dir, tie_to_parent=True, fresh=True
        )
        port = int(kafka_rec.address.rsplit(":", 1)[1])

        def start_kafka() -> services.ServiceRecord:
            # The same port and, for Apache Kafka, the same log directory: a broker restart.
            return services.start_broker(
                broker, log_dir, port=port, log_dir=log_dir, tie_to_parent=True
            )

        kafka, close_kafka = _process_handle("kafka", kafka_rec, start_kafka)
        closers.append(close_kafka)
        if shutil.which("redis-server"):
            url = f"redis://127.0.0.1:{services.free_port()}/0"
            redis_rec = services.start_redis(log_dir, url, log_dir=log_dir, tie_to_parent=True)

            def start_redis() -> services.ServiceRecord:
                return services.start_redis(
                    log_dir, redis_rec.address, log_dir=log_dir, tie_to_parent=True
                )

            redis, close_redis = _process_handle("redis", redis_rec, start_redis)
            closers.append(close_redis)
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
        broker=broker,
        description=f"embedded (kafka={_broker_name(broker)} process [{how}], redis={redis_desc})",
        env=settings_env(kafka.address, redis.address, tansu=broker == "tansu"),
        _closers=closers,
    )


# ----------------------------------------------------------------------------- entry points


def describe_planned() -> str:
    """The header line, decided without starting anything (images by name)."""
    try:
        mode, forced = choose_mode()
        broker, how = choose_broker() if mode != "env" else ("external", "")
    except ServicesUnavailable as exc:
        return f"services: error ({exc})"
    why = "forced by EPD_TEST_SERVICES" if forced else "auto"
    if mode == "env":
        kafka = os.environ.get("EPD_KAFKA_BOOTSTRAP", "default")
        redis = os.environ.get("EPD_REDIS_URL", "default")
        return f"services: env (kafka={kafka}, redis={redis}; {why})"
    name = _broker_name(broker)
    if mode == "containers":
        client = docker_client()
        if client is None:
            return f"services: testcontainers (no Docker engine answers; {why})"
        try:
            images = choose_images(client, broker, build=False)
        except ServicesUnavailable as exc:
            return f"services: testcontainers (images unavailable: {exc})"
        return (
            f"services: testcontainers (kafka={name} [{images.kafka}; {how}], "
            f"redis={images.redis}; {why})"
        )
    return f"services: embedded (kafka={name} process [{how}], redis-server; {why})"


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
    """The session's broker when it has transactions; else a new Apache Kafka node (from jars).

    Raises :class:`ServicesUnavailable` saying why no such broker can be had here.
    """
    if not session.kafka_is_tansu:
        return TransactionalKafka(session.kafka.address, f"session broker ({session.mode})")
    t0 = time.monotonic()
    try:
        _jars_ready()
        rec = services.start_apache_kafka(log_dir, log_dir=log_dir, tie_to_parent=True, fresh=True)
    except services.ServiceError as exc:
        raise ServicesUnavailable(f"no broker with transactions: {exc}") from exc
    return TransactionalKafka(
        rec.address,
        f"Apache Kafka from jars, ready in {time.monotonic() - t0:.1f}s",
        [lambda: services.stop_records([rec])],
    )


# ----------------------------------------------------------------------------- Redis Cluster


@dataclass
class RedisClusterHandle:
    """A Redis Cluster of ``redis-server --cluster-enabled yes`` processes, whatever the mode
    (a cluster is never a container here: the fault test kills one master with SIGKILL)."""

    nodes: services.RedisClusterNodes
    log_dir: Path

    @property
    def url(self) -> str:
        return self.nodes.url

    def masters(self) -> list[str]:
        """Addresses of the nodes that are masters now (after a failover too)."""
        return [a for a in self.nodes.addresses if _role(a) == "master"]

    def replica_of(self, master: str) -> str | None:
        """The address of a replica that follows ``master`` now, if any."""
        host, port = master.rsplit(":", 1)
        for addr in self.nodes.addresses:
            info = _info(addr, "replication")
            if info.get("role") == "slave" and (
                info.get("master_host"),
                info.get("master_port"),
            ) == (host, port):
                return addr
        return None

    def keys_per_master(self, pattern: str) -> dict[str, int]:
        """How many keys matching ``pattern`` each master holds (SCAN on every master)."""
        return {addr: len(self.keys_on(addr, pattern)) for addr in self.masters()}

    def keys_on(self, address: str, pattern: str) -> set[bytes]:
        """The keys matching ``pattern`` the node at ``address`` holds."""
        import redis

        host, port = address.rsplit(":", 1)
        client = redis.Redis(host=host, port=int(port), socket_timeout=5)
        try:
            return set(client.scan_iter(match=pattern, count=1000))
        finally:
            client.close()

    def cut_replication(self, master: str) -> int:
        """Close ``master``'s connections to its replicas (they reconnect within a second or
        so, unless frozen first): what it writes meanwhile reaches no replica."""
        import redis

        host, port = master.rsplit(":", 1)
        client = redis.Redis(host=host, port=int(port), socket_timeout=5)
        try:
            return int(client.execute_command("CLIENT", "KILL", "TYPE", "replica"))
        finally:
            client.close()

    def delete(self, pattern: str) -> None:
        """Delete the keys matching ``pattern`` on every master."""
        import redis

        for addr in self.masters():
            host, port = addr.rsplit(":", 1)
            client = redis.Redis(host=host, port=int(port), socket_timeout=5)
            try:
                for key in list(client.scan_iter(match=pattern, count=1000)):
                    client.delete(key)
            finally:
                client.close()

    def kill(self, address: str) -> None:
        """SIGKILL the node at ``address`` (it stays down)."""
        self.signal(address, signal.SIGKILL)
        for rec in self.nodes.nodes:
            if rec.address == address and rec.pid is not None:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(rec.pid, 0)

    def signal(self, address: str, sig: int) -> None:
        """Send ``sig`` to the node at ``address`` (SIGSTOP freezes it, SIGCONT resumes)."""
        for rec in self.nodes.nodes:
            if rec.address == address and rec.pid is not None:
                os.kill(rec.pid, sig)

    def close(self) -> None:
        services.stop_records([r for r in self.nodes.nodes])


def _info(address: str, section: str) -> dict[str, str]:
    import redis

    host, port = address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port), socket_timeout=2, socket_connect_timeout=2)
    try:
        return {k: str(v) for k, v in client.info(section).items()}
    except Exception:
        return {}
    finally:
        client.close()


def _role(address: str) -> str | None:
    return _info(address, "replication").get("role")


def redis_cluster(log_dir: Path, masters: int = 3, replicas: int = 0) -> RedisClusterHandle:
    """Start a local Redis Cluster for tests (processes tied to the pytest process)."""
    try:
        nodes = services.start_redis_cluster(
            log_dir, masters, replicas, log_dir=log_dir, tie_to_parent=True
        )
    except services.ServiceError as exc:
        raise ServicesUnavailable(f"no Redis Cluster: {exc}") from exc
    return RedisClusterHandle(nodes, log_dir)
