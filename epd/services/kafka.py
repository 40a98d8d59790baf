"""A real Apache Kafka broker from Maven jars: one KRaft node (broker + controller) on 127.0.0.1.

The production broker, run locally without Docker (``EPD_BROKER=apache``), by the test fixtures
(embedded mode) and, through :func:`image_context`, as the ``epd-kafka`` test container image.

* **Jars**: ``org.apache.kafka:kafka_{SCALA}:{KAFKA_VERSION}``, its runtime dependencies and the
  slf4j binding of its log4j2, copied by ``mvn dependency:copy-dependencies`` (from a generated
  pom) into a cache directory, ``$EPD_KAFKA_CACHE`` or ``~/.cache/epd/kafka-VERSION/libs``,
  resolved once (seconds from Maven Central) and reused. ``$EPD_KAFKA_LIBS`` names a ready
  directory of jars instead (the ``libs/`` of an unpacked distribution), for a machine that
  reaches no Maven registry.
* **Storage**: formatted on the first start (Kafka's own ``StorageTool``, a random cluster id, a
  static one-voter quorum) and kept: a restart on the same directory resumes with every topic,
  record and committed offset, as a real broker does. ``fresh=True`` starts empty.
* **Process**: ``java -cp 'libs/*' kafka.Kafka server.properties`` with the JVM of
  ``EPD_KAFKA_JVM_PROFILE`` (:data:`JVM_PROFILES`): ``fast`` (the default: a bounded heap,
  ``EPD_KAFKA_HEAP`` or 384m, the serial collector and C1-compiled code only, no perf-data
  sampling: it starts in about half the time, and no collector or C2 threads compete with the
  pipeline on two cores) or ``production`` (C2 tiered compilation, G1 with the settings
  Kafka's own start scripts use, a fixed 1g heap: what docker-compose.yml runs, and what the
  benchmarks measure); log4j2 at WARN, single-node settings (replication factor 1 for the
  internal topics, no initial rebalance delay, a small log-cleaner dedupe buffer: its 128 MiB
  default is a third of the heap, the controller's idle no-op record every 5 s, not every
  500 ms). Message caps follow ``EPD_MAX_MESSAGE_BYTES``.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from epd.services.config import LocalServices
from epd.services.probes import kafka_answers
from epd.services.processes import free_port, port_bindable, spawn, stop_process, wait_until
from epd.services.state import ServiceError, ServiceRecord

KAFKA_VERSION = "4.4.0"
SCALA = "2.13"
LOG4J = "2.25.5"
"""The log4j2 that kafka_2.13:4.4.0 depends on; its slf4j 1.x binding must match it."""
MIN_JAVA = 17
COMPLETE_MARKER = ".complete"
DATA_DIR = "kraft-data"
PROPERTIES = "server.properties"
MVN_TIMEOUT_S = 600.0
FORMAT_TIMEOUT_S = 120.0

INSTALL_HINT = (
    f"Apache Kafka needs Java {MIN_JAVA}+ (`java`) and `mvn` on PATH with a Maven registry that "
    f"serves org.apache.kafka:kafka_{SCALA}:{KAFKA_VERSION} (Debian: apt-get install "
    f"openjdk-{MIN_JAVA}-jre-headless maven), or EPD_KAFKA_LIBS set to the libs/ directory of an "
    "unpacked Kafka distribution; or run the light broker instead (EPD_BROKER=tansu)"
)

POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>epd.local</groupId>
  <artifactId>kafka-broker-libs</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_{scala}</artifactId>
      <version>{version}</version>
    </dependency>
    <!-- The broker logs through slf4j 1.7; without a binding it logs nothing at all. -->
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j}</version>
    </dependency>
  </dependencies>
</project>
"""

# Kafka 4 logs through log4j2; its default (INFO to stdout) writes megabytes per test session.
LOG4J2 = """status = error
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka.server.KafkaServer
logger.kafka.level = INFO
"""


class KafkaJarsUnavailable(ServiceError):
    """Java or the broker's jars could not be found or resolved (no java/mvn, no registry)."""


# ---------------------------------------------------------------- java and jars


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` or ``java`` on PATH, Java 17 or newer (else KafkaJarsUnavailable)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        java = str(Path(home) / "bin" / "java")
    else:
        found = shutil.which("java")
        if found is None:
            raise KafkaJarsUnavailable(f"java not found; {INSTALL_HINT}")
        java = found
    major = java_major(java)
    if major < MIN_JAVA:
        raise KafkaJarsUnavailable(f"{java} is Java {major}; {INSTALL_HINT}")
    return java


@cache
def java_major(java: str) -> int:
    """The feature release of ``java`` (``17`` for 17.0.15; ``8`` for 1.8), 0 when unreadable."""
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    found = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not found:
        return 0
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def cache_dir() -> Path:
    """Where resolved jars live: ``$EPD_KAFKA_CACHE`` or ``~/.cache/epd/kafka-VERSION/libs``."""
    configured = LocalServices().kafka_cache
    if configured is not None:
        return configured
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "epd" / f"kafka-{KAFKA_VERSION}" / "libs"


def _has_broker(libs: Path) -> bool:
    return any(libs.glob(f"kafka_{SCALA}-*.jar"))


def ready_jars() -> Path | None:
    """The jars' directory when no resolution is needed (``EPD_KAFKA_LIBS``, a complete cache)."""
    given = LocalServices().kafka_libs
    if given is not None:
        return given if _has_broker(given) else None
    libs = cache_dir()
    return libs if (libs / COMPLETE_MARKER).is_file() and _has_broker(libs) else None


def unavailable_reason() -> str | None:
    """Why this machine cannot run the broker (no Java 17+, no jars and no ``mvn``), else None.

    Cheap: it resolves nothing, so a caller can decide which broker to start (``auto``)."""
    try:
        java_binary()
    except KafkaJarsUnavailable as exc:
        return str(exc)
    if LocalServices().kafka_libs is not None and ready_jars() is None:
        return f"EPD_KAFKA_LIBS={LocalServices().kafka_libs} holds no kafka_{SCALA}-*.jar"
    if ready_jars() is None and shutil.which("mvn") is None:
        return f"mvn not found and no cached jars; {INSTALL_HINT}"
    return None


def resolve_jars(*, timeout_s: float = MVN_TIMEOUT_S) -> Path:
    """The directory of the broker's jars, resolved with Maven on first use, then reused.

    Raises :class:`KafkaJarsUnavailable` naming what is missing (java, mvn, or the registry).
    """
    given = LocalServices().kafka_libs
    if given is not None:
        if not _has_broker(given):
            raise KafkaJarsUnavailable(f"EPD_KAFKA_LIBS={given} holds no kafka_{SCALA}-*.jar")
        return given
    ready = ready_jars()
    if ready is not None:
        return ready
    java_binary()
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaJarsUnavailable(f"mvn not found; {INSTALL_HINT}")
    libs = cache_dir()
    libs.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=libs.parent, prefix=".resolve-") as tmp:
        out = _mvn_copy_dependencies(mvn, Path(tmp), timeout_s)
        (out / COMPLETE_MARKER).write_text(f"kafka_{SCALA}:{KAFKA_VERSION}\n")
        if libs.exists():
            shutil.rmtree(libs)
        out.rename(libs)  # atomic within one filesystem: a reader sees all jars or none
    return libs


def _mvn_copy_dependencies(mvn: str, work: Path, timeout_s: float) -> Path:
    (work / "pom.xml").write_text(POM.format(scala=SCALA, version=KAFKA_VERSION, log4j=LOG4J))
    out = work / "libs"
    cmd = [
        mvn,
        "-B",
        "-q",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={out}",
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=work, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise KafkaJarsUnavailable(f"mvn did not finish in {timeout_s:.0f}s") from exc
    if proc.returncode != 0 or not _has_broker(out):
        raise KafkaJarsUnavailable(
            f"mvn could not resolve the broker's jars ({_mvn_error(proc.stdout + proc.stderr)}"
            f"); {INSTALL_HINT}"
        )
    return out


def _mvn_error(output: str) -> str:
    """The first ``[ERROR]`` line of Maven's output, without colour codes (it names the cause)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    for line in plain.splitlines():
        if line.startswith("[ERROR]") and line.strip() != "[ERROR]":
            return line.removeprefix("[ERROR]").strip()[:400]
    return plain.strip()[-400:]


# ---------------------------------------------------------------- the node's configuration


def cluster_id() -> str:
    """A random Kafka cluster id (a UUID in unpadded URL-safe base64, as ``random-uuid`` prints)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def server_properties(
    *, port: int, controller_port: int, log_dir: Path | str, max_message_bytes: int, partitions: int
) -> dict[str, str]:
    """``server.properties`` of a one-node KRaft cluster on 127.0.0.1 (ports as given)."""
    return {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": str(partitions),
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # As in production (docker-compose.yml): topics are made by `epd topics create` and
        # the workers, with their partitions and caps, never by a stray produce or fetch.
        "auto.create.topics.enable": "false",
        "message.max.bytes": str(max_message_bytes),
        "replica.fetch.max.bytes": str(max_message_bytes),
        "socket.request.max.bytes": str(max(max_message_bytes * 2, 104857600)),
        "num.network.threads": "2",
        "num.io.threads": "2",
        "num.recovery.threads.per.data.dir": "1",
        # A handful of consumer groups: one coordinator thread, not four waking 5 times a second.
        "group.coordinator.threads": "1",
        # One cleaner thread with an 8 MiB dedupe buffer (128 MiB by default: a third of the
        # heap); only the compacted internal topics use it on a node like this.
        "log.cleaner.threads": "1",
        "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
        "log.retention.hours": "24",
        # The active controller appends a no-op record to the metadata log this often when
        # nothing else happens (500 ms by default), which the node then writes, replicates to
        # itself and publishes: the largest part of an idle node's CPU. One voter has no
        # follower to prove its liveness to.
        "metadata.max.idle.interval.ms": "5000",
    }


SHARED_WITH_COMPOSE = (
    "offsets.topic.replication.factor",
    "transaction.state.log.replication.factor",
    "transaction.state.log.min.isr",
    "group.initial.rebalance.delay.ms",
    "auto.create.topics.enable",
    "message.max.bytes",
    "replica.fetch.max.bytes",
)
"""Broker settings the production stack (docker-compose.yml) and this node must agree on (a
test checks it): the rest are ports, paths, and the sizing of a small test node."""


def render_properties(props: dict[str, str]) -> str:
    """``key=value`` lines."""
    return "".join(f"{k}={v}\n" for k, v in props.items())


@dataclass(frozen=True)
class JvmProfile:
    """One way to run the broker's JVM: its default heap and its flags (heap aside)."""

    heap: str
    fixed_heap: bool
    """-Xms as large as -Xmx (production: the heap never grows or shrinks under load)."""
    flags: tuple[str, ...]

    def heap_options(self, heap: str | None = None) -> list[str]:
        size = heap or self.heap
        return [f"-Xmx{size}", f"-Xms{size}" if self.fixed_heap else "-Xms64m"]


JVM_PROFILES: dict[str, JvmProfile] = {
    "fast": JvmProfile(
        "384m",
        fixed_heap=False,
        flags=(
            "-XX:+UseSerialGC",  # two cores: no parallel collector threads to compete with tests
            "-XX:TieredStopAtLevel=1",  # start in ~half the time; a test broker needs no C2 code
            "-XX:-UsePerfData",  # no hsperfdata sampling every 50 ms (jstat cannot attach)
            "-Djava.awt.headless=true",
        ),
    ),
    # Kafka's own KAFKA_HEAP_OPTS and KAFKA_JVM_PERFORMANCE_OPTS defaults (its start scripts,
    # bin/kafka-server-start.sh and bin/kafka-run-class.sh): docker-compose.yml sets the same
    # (a test checks it).
    "production": JvmProfile(
        "1g",
        fixed_heap=True,
        flags=(
            "-server",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent",
            "-XX:MaxInlineLevel=15",
            "-Djava.awt.headless=true",
        ),
    ),
}
"""The broker's JVM, by ``EPD_KAFKA_JVM_PROFILE``."""


def java_options(
    log4j: Path | str,
    logs_dir: Path | str,
    heap: str | None = None,
    profile: str | None = None,
) -> list[str]:
    """JVM flags of ``profile`` (default ``EPD_KAFKA_JVM_PROFILE``) with ``heap`` (default
    ``EPD_KAFKA_HEAP``, else the profile's), and a quiet log4j2 (its file at ``log4j``)."""
    services = LocalServices()
    jvm = JVM_PROFILES[profile or services.kafka_jvm_profile]
    return [
        *jvm.heap_options(heap or services.kafka_heap),
        *jvm.flags,
        f"-Dlog4j2.configurationFile={log4j}",
        f"-Dkafka.logs.dir={logs_dir}",
    ]


def _previous_controller_port(props_file: Path) -> int | None:
    """The controller port a node on this directory used last time, when it is free again."""
    try:
        text = props_file.read_text()
    except OSError:
        return None
    found = re.search(r"^controller\.quorum\.voters=1@127\.0\.0\.1:(\d+)$", text, re.M)
    if found and port_bindable(int(found.group(1))):
        return int(found.group(1))
    return None


def prepare(
    directory: Path,
    *,
    port: int,
    max_message_bytes: int,
    partitions: int,
    heap: str | None = None,
    fresh: bool = False,
) -> list[str]:
    """Resolve the jars, write the node's files under ``directory`` and format its storage on the
    first start (``fresh``: wipe it first); return the broker's command line."""
    libs = resolve_jars()
    java = java_binary()
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / DATA_DIR
    if fresh and data.exists():
        shutil.rmtree(data)
    props_file = directory / PROPERTIES
    controller = _previous_controller_port(props_file) if data.exists() else None
    props = server_properties(
        port=port,
        controller_port=controller or free_port(),
        log_dir=data,
        max_message_bytes=max_message_bytes,
        partitions=partitions,
    )
    props_file.write_text(render_properties(props))
    log4j = directory / "log4j2.properties"
    log4j.write_text(LOG4J2)
    base = [java, *java_options(log4j, directory, heap)]
    base += ["-cp", f"{libs}/*"]
    if not (data / "meta.properties").is_file():
        _format(base, props_file)
    return [*base, "kafka.Kafka", str(props_file)]


def _format(base: list[str], props_file: Path) -> None:
    # ``--cluster-id=ID``: a random id may start with "-", which argparse takes for a flag.
    cmd = [*base, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id()}"]
    proc = subprocess.run(
        [*cmd, "-c", str(props_file)],
        capture_output=True,
        text=True,
        timeout=FORMAT_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise KafkaJarsUnavailable(
            f"formatting the KRaft storage failed ({proc.returncode}): "
            f"{(proc.stdout + proc.stderr).strip()[-800:]}"
        )


# ---------------------------------------------------------------- start


def start_apache_kafka(
    directory: Path,
    *,
    port: int | None = None,
    log_dir: Path | None = None,
    timeout_s: float = 90.0,
    tie_to_parent: bool = False,
    max_message_bytes: int | None = None,
    fresh: bool = False,
) -> ServiceRecord:
    """Start the Apache Kafka node of ``directory/apache-kafka`` on 127.0.0.1 (its data kept
    there across restarts; ``fresh``: wiped first) and wait until it answers metadata requests."""
    from runtime.settings import Settings

    settings = Settings()
    node_dir = directory / "apache-kafka"
    log = (log_dir or directory) / "apache-kafka.log"
    p = port or free_port()
    cmd = prepare(
        node_dir,
        port=p,
        max_message_bytes=max_message_bytes or settings.max_message_bytes,
        partitions=settings.topic_partitions,
        fresh=fresh,
    )
    proc = spawn(cmd, log, cwd=node_dir, tie_to_parent=tie_to_parent)
    bootstrap = f"127.0.0.1:{p}"
    if wait_until(
        lambda: kafka_answers(bootstrap, timeout_s=2.0),
        timeout_s,
        alive=lambda: proc.poll() is None,
    ):
        return ServiceRecord("kafka", bootstrap, True, proc.pid, cmd, str(log))
    last = f"exit code {proc.poll()}" if proc.poll() is not None else "no answer"
    stop_process(proc.pid, cmd)
    proc.wait()
    raise ServiceError(f"Apache Kafka did not come up on {bootstrap} ({last}); see {log}")
