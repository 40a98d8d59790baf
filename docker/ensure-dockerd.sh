#!/usr/bin/env bash
# Make sure a Docker daemon answers, starting one if we can (root, dockerd present).
#
#   docker/ensure-dockerd.sh [--install] [--pidfile FILE] [--log FILE] [--timeout SECONDS]
#
# --install   apt-get install docker.io when dockerd is missing (needs root and apt-get).
# EPD_DOCKER_STORAGE_DRIVER overrides the storage driver (overlay2 or vfs; default: probed).
# --pidfile   where to write the pid of a daemon this script started (the file is NOT written
#             when a daemon already answered, so a caller stops only what it started).
# The daemon runs the way this sandbox allows: no iptables, no bridge (containers must use host
# networking), overlay2 storage where the kernel mounts an overlay, else vfs. vfs copies every
# layer and every container's root filesystem whole, which a multi-GB image (the app image of
# the compose test) cannot afford; overlay2 shares them. Images persist in dockerd's data-root
# (/var/lib/docker) between runs, per storage driver. Exit 0 when `docker info` answers, 1
# otherwise (with the reason).
set -euo pipefail

install=0
pidfile=""
log="${TMPDIR:-/tmp}/epd-dockerd.log"
timeout=90
while [ $# -gt 0 ]; do
    case "$1" in
        --install) install=1 ;;
        --pidfile) pidfile="$2"; shift ;;
        --log) log="$2"; shift ;;
        --timeout) timeout="$2"; shift ;;
        *) echo "ensure-dockerd: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

say() { echo "ensure-dockerd: $*" >&2; }

if ! command -v docker >/dev/null 2>&1 && [ "$install" = 0 ]; then
    say "no docker client on PATH (install docker.io)"
    exit 1
fi
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    say "a Docker daemon already answers"
    exit 0
fi

if ! command -v dockerd >/dev/null 2>&1; then
    if [ "$install" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "dockerd missing; installing docker.io with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >&2
        apt-get install -y -qq docker.io >&2
    else
        say "dockerd not found (install it: apt-get install docker.io)"
        exit 1
    fi
fi
if [ "$(id -u)" != 0 ]; then
    say "dockerd is installed but no daemon answers, and only root can start one here"
    exit 1
fi

# A daemon that died uncleanly leaves its pid file behind, and a new one refuses to start.
if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
    rm -f /var/run/docker.pid
fi

# overlay2 when a probe mount works (a VM with an ext4 root), vfs where overlays are refused.
storage_driver() {
    local probe ok=vfs
    probe="$(mktemp -d)"
    mkdir -p "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
    if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
        "$probe/merged" 2>/dev/null; then
        umount "$probe/merged" && ok=overlay2
    fi
    rm -rf "$probe"
    echo "$ok"
}
driver="${EPD_DOCKER_STORAGE_DRIVER:-$(storage_driver)}"

mkdir -p "$(dirname "$log")"
say "starting dockerd with $driver storage (log: $log)"
# setsid + redirected stdio: the daemon holds none of the caller's descriptors open.
setsid dockerd --storage-driver="$driver" --iptables=false --ip-masq=false --bridge=none \
    </dev/null >>"$log" 2>&1 &
pid=$!
if [ -n "$pidfile" ]; then
    mkdir -p "$(dirname "$pidfile")"
    echo "$pid" >"$pidfile"
fi

deadline=$((SECONDS + timeout))
until docker info >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
        say "dockerd exited; last lines of $log:"
        tail -n 30 "$log" >&2 || true
        [ -n "$pidfile" ] && rm -f "$pidfile"
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        say "dockerd did not answer within ${timeout}s; last lines of $log:"
        tail -n 30 "$log" >&2 || true
        exit 1
    fi
    sleep 1
done
say "dockerd up (pid $pid)"
