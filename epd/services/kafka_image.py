"""The ``epd-kafka`` test container image: what of it this project writes (the Kafka part).

``docker/build-images.sh`` calls ``python -m epd.services.kafka_image image-tag`` and
``image-context ROOTFS``, then adds a Java runtime and ``/bin/sh``. The image runs the same
broker, with the same properties and JVM flags, as :mod:`epd.services.kafka` runs from the jars.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from epd.services.kafka import (
    COMPLETE_MARKER,
    JVM_PROFILES,
    KAFKA_VERSION,
    LOG4J,
    LOG4J2,
    java_options,
    resolve_jars,
)
from epd.services.state import ServiceError

IMAGE_NAME = "epd-kafka"
IMAGE_LOG_DIR = "/var/lib/kafka/data"
IMAGE_ENTRYPOINT = """#!/bin/sh
# The epd-kafka image's entrypoint, two ways to configure it:
# - arguments (the test layer): each one key=value line of server.properties; JAVA_OPTS are the
#   JVM flags and CLUSTER_ID names the new cluster;
# - no arguments (the official apache/kafka image's contract, which docker-compose.yml uses):
#   every KAFKA_<NAME> variable is the property <name> (lower case, "_" -> ".", "__" -> "_",
#   "___" -> "-"), log.dirs defaults to /var/lib/kafka/data, and the JVM flags come from
#   KAFKA_HEAP_OPTS, KAFKA_JVM_PERFORMANCE_OPTS and KAFKA_OPTS (defaults: Kafka's own).
# The log directory is formatted on the first start only (a restarted container keeps its
# data), then the broker runs in the foreground.
set -eu
conf=/opt/kafka/server.properties
logdir=/var/lib/kafka/data
: > "$conf"
if [ "$#" -eq 0 ]; then
    env | while IFS='=' read -r name value; do
        case "$name" in
            KAFKA_HEAP_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_OPTS|KAFKA_LOG4J_OPTS) ;;
            KAFKA_JMX_OPTS|KAFKA_GC_LOG_OPTS|KAFKA_VERSION) ;;
            KAFKA_*)
                key="$(printf '%s' "${name#KAFKA_}" | sed -e 's/___/-/g' -e 's/__/@/g' \\
                    -e 's/_/./g' -e 's/@/_/g' -e 's/.*/\\L&/')"
                printf '%s=%s\\n' "$key" "$value" >> "$conf" ;;
        esac
    done
    if ! grep -q '^log[.]dirs=' "$conf"; then printf 'log.dirs=%s\\n' "$logdir" >> "$conf"; fi
    JAVA_OPTS="${KAFKA_HEAP_OPTS:-@HEAP@} ${KAFKA_JVM_PERFORMANCE_OPTS:-@FLAGS@}"
    JAVA_OPTS="$JAVA_OPTS ${KAFKA_OPTS:-} @LOGGING@"
    CLUSTER_ID="${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}"
fi
for kv in "$@"; do
    printf '%s\\n' "$kv" >> "$conf"
done
logdir="$(sed -n 's/^log[.]dirs=//p' "$conf")"
if [ ! -f "${logdir:?no log.dirs}/meta.properties" ]; then
    /opt/java/bin/java $JAVA_OPTS -cp '/opt/kafka/libs/*' kafka.tools.StorageTool format \\
        "--cluster-id=${CLUSTER_ID:?set CLUSTER_ID to format a new log directory}" -c "$conf"
fi
exec /opt/java/bin/java $JAVA_OPTS -cp '/opt/kafka/libs/*' kafka.Kafka "$conf"
"""
# Kafka's own defaults for the official-image way (the production profile is Kafka's start
# scripts' settings), and the image's quiet log4j2.
_PRODUCTION = JVM_PROFILES["production"]
IMAGE_ENTRYPOINT = (
    IMAGE_ENTRYPOINT.replace("@HEAP@", " ".join(_PRODUCTION.heap_options()))
    .replace("@FLAGS@", " ".join(_PRODUCTION.flags))
    .replace(
        "@LOGGING@", "-Dlog4j2.configurationFile=/opt/kafka/log4j2.properties -Dkafka.logs.dir=/tmp"
    )
)


def image_tag() -> str:
    """``epd-kafka:VERSION-HASH``: the hash covers the entrypoint and the logging config, so an
    image built from older files is never taken for this one."""
    digest = hashlib.sha256(f"{KAFKA_VERSION}\n{LOG4J}\n{IMAGE_ENTRYPOINT}\n{LOG4J2}".encode())
    return f"{IMAGE_NAME}:{KAFKA_VERSION}-{digest.hexdigest()[:8]}"


def image_context(rootfs: Path) -> None:
    """Write the Kafka part of the image's root filesystem under ``rootfs`` (``opt/kafka``: the
    jars, log4j2 config and entrypoint; the log directory). ``docker/build-images.sh`` adds the
    Java runtime and ``/bin/sh``."""
    libs = resolve_jars()
    kafka = rootfs / "opt" / "kafka"
    shutil.copytree(libs, kafka / "libs", ignore=shutil.ignore_patterns(COMPLETE_MARKER))
    (kafka / "log4j2.properties").write_text(LOG4J2)
    (kafka / "run.sh").write_text(IMAGE_ENTRYPOINT)
    (rootfs / IMAGE_LOG_DIR.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").mkdir(exist_ok=True)


def container_options(heap: str | None = None, profile: str | None = None) -> str:
    """``JAVA_OPTS`` for the image (its log4j2 config inside it), of ``profile`` (default
    ``EPD_KAFKA_JVM_PROFILE``)."""
    return " ".join(java_options("/opt/kafka/log4j2.properties", "/tmp", heap, profile))


def _main(argv: list[str]) -> int:
    """``python -m epd.services.kafka_image image-tag | image-context ROOTFS | jars``."""
    try:
        if argv == ["image-tag"]:
            print(image_tag())
        elif len(argv) == 2 and argv[0] == "image-context":
            image_context(Path(argv[1]))
        elif argv == ["jars"]:
            print(resolve_jars())
        else:
            print("usage: python -m epd.services.kafka_image image-tag|image-context DIR|jars")
            return 2
    except ServiceError as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
