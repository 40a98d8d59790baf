"""A real Apache Kafka broker from Maven jars: one KRaft node (broker + controller) on 127.0.0.1.

Tansu (the default embedded broker) has no transactions and answers an idle fetch only when
``fetch.max.wait`` ends; this broker is the one to test transactions and latency against without
Docker. What it needs and does:

* **Jars**: ``org.apache.kafka:kafka_2.13:{KAFKA_VERSION}`` and its runtime dependencies, copied
  by ``mvn dependency:copy-dependencies`` (from a generated pom) into a cache directory,
  ``$EPD_KAFKA_CACHE`` or ``~/.cache/epd/kafka-{KAFKA_VERSION}/libs``, reused once complete.
  ``$EPD_KAFKA_LIBS`` names a ready directory of jars instead (the ``libs/`` of an unpacked
  Kafka distribution), for a machine that reaches no Maven registry.
* **Storage**: a fresh log directory per start, formatted by Kafka's own ``StorageTool`` with a
  random cluster id and a static one-voter quorum (``controller.quorum.voters``).
* **Process**: ``java -cp 'libs/*' kafka.Kafka server.properties`` with a small heap and log4j
  at WARN; message caps follow ``EPD_MAX_MESSAGE_BYTES`` like the container arguments do.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

KAFKA_VERSION = "4.4.0"
SCALA = "2.13"
COMPLETE_MARKER = ".complete"
DEFAULT_HEAP = "384m"
MVN_TIMEOUT_S = 600.0
FORMAT_TIMEOUT_S = 120.0

INSTALL_HINT = (
    "Apache Kafka needs `java` (17+) and `mvn` on PATH and a Maven registry that serves "
    f"org.apache.kafka:kafka_{SCALA}:{KAFKA_VERSION}; or set EPD_KAFKA_LIBS to the libs/ "
    "directory of an unpacked Kafka distribution"
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


class KafkaJarsUnavailable(RuntimeError):
    """The broker's jars could not be found or resolved (no java/mvn, no registry)."""


def cache_dir() -> Path:
    """Where resolved jars live: ``$EPD_KAFKA_CACHE`` or ``~/.cache/epd/kafka-VERSION/libs``."""
    env = os.environ.get("EPD_KAFKA_CACHE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "epd" / f"kafka-{KAFKA_VERSION}" / "libs"


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` or ``java`` on PATH; KafkaJarsUnavailable if neither."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise KafkaJarsUnavailable(f"java not found; {INSTALL_HINT}")
    return found


def _has_broker(libs: Path) -> bool:
    return any(libs.glob(f"kafka_{SCALA}-*.jar"))


def resolve_jars(*, timeout_s: float = MVN_TIMEOUT_S) -> Path:
    """The directory of the broker's jars, resolved with Maven on first use (minutes), then reused.

    Raises :class:`KafkaJarsUnavailable` naming what is missing (java, mvn, or the registry).
    """
    given = os.environ.get("EPD_KAFKA_LIBS")
    if given:
        libs = Path(given)
        if not _has_broker(libs):
            raise KafkaJarsUnavailable(f"EPD_KAFKA_LIBS={given} holds no kafka_{SCALA}-*.jar")
        return libs
    libs = cache_dir()
    if (libs / COMPLETE_MARKER).is_file() and _has_broker(libs):
        return libs
    java_binary()
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaJarsUnavailable(f"mvn not found; {INSTALL_HINT}")
    libs.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=libs.parent, prefix=".resolve-") as tmp:
        work = Path(tmp)
        (work / "pom.xml").write_text(POM.format(scala=SCALA, version=KAFKA_VERSION))
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
        (out / COMPLETE_MARKER).write_text(f"kafka_{SCALA}:{KAFKA_VERSION}\n")
        if libs.exists():
            shutil.rmtree(libs)
        out.rename(libs)  # atomic within one filesystem: a reader sees all jars or none
    return libs


def _mvn_error(output: str) -> str:
    """The first ``[ERROR]`` line of Maven's output, without colour codes (it names the cause)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    for line in plain.splitlines():
        if line.startswith("[ERROR]") and line.strip() != "[ERROR]":
            return line.removeprefix("[ERROR]").strip()[:400]
    return plain.strip()[-400:]


def cluster_id() -> str:
    """A random Kafka cluster id (a UUID in unpadded URL-safe base64, as ``random-uuid`` prints)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def server_properties(
    *, port: int, controller_port: int, log_dir: Path, max_message_bytes: int, partitions: int
) -> str:
    """``server.properties`` of a one-node KRaft cluster on 127.0.0.1 (ports as given)."""
    props = {
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
        "message.max.bytes": str(max_message_bytes),
        "replica.fetch.max.bytes": str(max_message_bytes),
        "socket.request.max.bytes": str(max(max_message_bytes * 2, 104857600)),
        "num.network.threads": "2",
        "num.io.threads": "2",
        "num.recovery.threads.per.data.dir": "1",
        "log.retention.hours": "24",
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def java_options(directory: Path, heap: str = DEFAULT_HEAP) -> list[str]:
    """JVM flags: a small heap, quick start (C1 only), quiet log4j2 writing under ``directory``."""
    log4j = directory / "log4j2.properties"
    log4j.write_text(LOG4J2)
    return [
        f"-Xmx{heap}",
        "-Xms64m",
        "-XX:+UseSerialGC",  # two cores: no parallel collector threads to compete with tests
        "-XX:TieredStopAtLevel=1",  # start in ~half the time; a test broker needs no C2 code
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={log4j}",
        f"-Dkafka.logs.dir={directory}",
    ]


def prepare(
    directory: Path,
    *,
    port: int,
    controller_port: int,
    max_message_bytes: int,
    partitions: int,
    heap: str = DEFAULT_HEAP,
) -> list[str]:
    """Resolve the jars, write and format a fresh node under ``directory``; return its command."""
    libs = resolve_jars()
    java = java_binary()
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "kraft-data"
    if data.exists():
        shutil.rmtree(data)  # every start is a new, empty cluster (as Tansu's memory storage)
    props = directory / "server.properties"
    props.write_text(
        server_properties(
            port=port,
            controller_port=controller_port,
            log_dir=data,
            max_message_bytes=max_message_bytes,
            partitions=partitions,
        )
    )
    base = [java, *java_options(directory, heap), "-cp", f"{libs}/*"]
    fmt = [*base, "kafka.tools.StorageTool", "format", "-t", cluster_id(), "-c", str(props)]
    proc = subprocess.run(
        fmt, capture_output=True, text=True, timeout=FORMAT_TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        raise KafkaJarsUnavailable(
            f"formatting the KRaft storage failed ({proc.returncode}): "
            f"{(proc.stdout + proc.stderr).strip()[-800:]}"
        )
    return [*base, "kafka.Kafka", str(props)]
