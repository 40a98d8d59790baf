#!/usr/bin/env bash
# Builds the pinned command-line tools the tests and CI use into .tools/bin (git-ignored), from
# their package registries, and prints each one's path on stdout.
#
#   tools/install-tools.sh promtool [TOOL...]
#
# Idempotent: a tool already built at its pinned version is not built again (a Go binary says
# which module version it was built from, so a stale one is rebuilt after a pin moves). Go's
# module and build caches ($HOME/go, $HOME/.cache/go-build) make a rebuild on the same machine
# fast; the first build of promtool takes minutes on two cores.
#
# One case per tool in `install_one`; the shared helpers build from a registry. TOOLS_BIN
# overrides the target folder, GO the go command.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_BIN="${TOOLS_BIN:-$ROOT/.tools/bin}"

# Pins. promtool comes from the Prometheus module (its Go module versions are v0.3xx.y for
# Prometheus 3.xx.y).
PROMTOOL_MODULE=github.com/prometheus/prometheus
PROMTOOL_VERSION=v0.316.0

say() { echo "install-tools: $*" >&2; }

go_cmd() {
    local go="${GO:-}"
    if [ -z "$go" ]; then
        go="$(command -v go || true)"
        [ -n "$go" ] || [ ! -x /usr/local/go/bin/go ] || go=/usr/local/go/bin/go
    fi
    [ -n "$go" ] || { say "no go command (install Go, or set GO=/path/to/go)"; return 1; }
    echo "$go"
}

# The module version a Go binary was built from (empty if it is missing or not from MODULE).
go_built_version() {
    local bin="$1" module="$2"
    [ -x "$bin" ] || return 0
    "$(go_cmd)" version -m "$bin" 2>/dev/null | awk -v m="$module" '$1 == "mod" && $2 == m { print $3 }'
}

# go_tool NAME PACKAGE MODULE VERSION: `go install PACKAGE@VERSION` into TOOLS_BIN, unless the
# binary there was built from MODULE at VERSION already.
go_tool() {
    local name="$1" package="$2" module="$3" version="$4"
    local bin="$TOOLS_BIN/$name"
    if [ "$(go_built_version "$bin" "$module")" = "$version" ]; then
        say "$name $version is built already"
    else
        local go start
        go="$(go_cmd)"
        say "building $name $version ($package, $("$go" env GOVERSION)); the first build takes minutes"
        mkdir -p "$TOOLS_BIN"
        start=$SECONDS
        GOBIN="$TOOLS_BIN" "$go" install "$package@$version"
        say "built $name $version in $((SECONDS - start)) s"
        [ "$(go_built_version "$bin" "$module")" = "$version" ] || {
            say "$bin is not $module $version after the build"
            return 1
        }
    fi
    echo "$bin"
}

install_one() {
    case "$1" in
        promtool)
            go_tool promtool "$PROMTOOL_MODULE/cmd/promtool" "$PROMTOOL_MODULE" "$PROMTOOL_VERSION"
            ;;
        *)
            say "unknown tool '$1' (known: promtool)"
            return 2
            ;;
    esac
}

if [ $# -eq 0 ]; then
    sed -n 's/^#   //p' "${BASH_SOURCE[0]}" >&2
    exit 2
fi
for tool in "$@"; do
    install_one "$tool"
done
