#!/usr/bin/env bash
# tools/install-tools.sh TOOL...: the pinned command-line tools of the tests and CI, built or
# fetched from the Go module proxy (the one place this project's machines get Go code from) into
# .tools/ (git-ignored). Prints each tool's path, one line per tool in the order asked.
# Idempotent: a tool already there at its pinned version is not fetched again, so a second run
# takes about a second (Go's module and build caches in $HOME make a rebuild fast too).
#
#   tools/install-tools.sh helm          .tools/bin/helm, built from helm.sh/helm/v4 at HELM_VERSION
#   tools/install-tools.sh promtool      .tools/bin/promtool, built from the Prometheus module at
#                                        PROMTOOL_VERSION (its first build takes ~10 minutes on
#                                        two cores)
#   tools/install-tools.sh k8s-schemas   .tools/schemas/kubernetes-<v>/ (the OpenAPI v3 spec of
#                                        k8s.io/kubernetes) and .tools/schemas/keda-<v>/ (KEDA's
#                                        CRDs and its kafka scaler's parameter declarations),
#                                        read by tests/helm_schemas.py
#
# Versions are pinned here, the one home of these facts (tests/helm_schemas.py reads them back).
# Adding a tool: a case in `install` below and a function that builds it.
set -euo pipefail
# A failure inside $(...) (a build, a download) fails the script, not only the substitution.
shopt -s inherit_errexit

HELM_VERSION=v4.3.2
# The Kubernetes release whose API helm v4.3.2 is built against (k8s.io/api v0.37.2).
KUBERNETES_VERSION=v1.37.2
# KEDA v2.21.1 asks for Go 1.27.4 in its go.mod, which `go mod download` refuses on this Go
# (1.26.8); v2.21.0 is the newest release it accepts.
KEDA_VERSION=v2.21.0
# promtool comes from the Prometheus module (its Go module versions are v0.3xx.y for Prometheus
# 3.xx.y).
PROMTOOL_MODULE=github.com/prometheus/prometheus
PROMTOOL_VERSION=v0.316.0

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
# Go's own toolchain on this machine; GOTOOLCHAIN=local so a module asking for a newer Go fails
# here, loudly, instead of fetching another toolchain behind our back.
go="$(command -v go || echo /usr/local/go/bin/go)"
export GOTOOLCHAIN=local

say() { echo "install-tools: $*" >&2; }

if [ ! -x "$go" ]; then
    say "needs Go (1.26 or newer) on PATH or at /usr/local/go/bin/go"
    exit 1
fi

# The directory of module $1 at version $2, downloaded (not built) through the module proxy.
module_dir() {
    local json dir
    json="$(cd "$tools" && "$go" mod download -json "$1@$2")"
    dir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$json")"
    if [ -z "$dir" ] || [ ! -d "$dir" ]; then
        say "go mod download $1@$2 gave no directory:"
        echo "$json" >&2
        return 1
    fi
    echo "$dir"
}

# go_tool NAME PACKAGE MODULE VERSION: `go install PACKAGE@VERSION` into .tools/bin, unless the
# binary there was built from MODULE at VERSION already (`go version -m` reads the module version
# a binary was built from: the pin, checked; the tools' own --version may not say it).
go_tool() {
    local name="$1" package="$2" module="$3" version="$4" bin="$tools/bin/$1"
    if [ -x "$bin" ] && "$go" version -m "$bin" 2>/dev/null |
        awk -v m="$module" -v v="$version" '$1 == "mod" && $2 == m && $3 == v { ok = 1 } END { exit !ok }'; then
        echo "$bin"
        return
    fi
    say "building $name $version from $module (minutes the first time)"
    local start=$SECONDS
    GOBIN="$tools/bin" "$go" install "$package@$version"
    say "built $name $version in $((SECONDS - start)) s"
    echo "$bin"
}

install_helm() {
    go_tool helm helm.sh/helm/v4/cmd/helm helm.sh/helm/v4 "$HELM_VERSION"
}

install_promtool() {
    go_tool promtool "$PROMTOOL_MODULE/cmd/promtool" "$PROMTOOL_MODULE" "$PROMTOOL_VERSION"
}

install_k8s_schemas() {
    local dest="$tools/schemas" k8s="$tools/schemas/kubernetes-$KUBERNETES_VERSION"
    local keda="$tools/schemas/keda-$KEDA_VERSION" src
    if [ ! -f "$k8s/.complete" ]; then
        say "fetching the OpenAPI v3 spec of k8s.io/kubernetes $KUBERNETES_VERSION (module zip)"
        src="$(module_dir k8s.io/kubernetes "$KUBERNETES_VERSION")"
        rm -rf "$k8s" && mkdir -p "$k8s"
        cp "$src"/api/openapi-spec/v3/*.json "$k8s/"
        chmod -R u+w "$k8s"
        touch "$k8s/.complete"
    fi
    if [ ! -f "$keda/.complete" ] || [ ! -f "$keda/kafka_scaler.go" ]; then
        say "fetching KEDA $KEDA_VERSION's CRDs (github.com/kedacore/keda/v2 module zip)"
        src="$(module_dir github.com/kedacore/keda/v2 "$KEDA_VERSION")"
        rm -rf "$keda" && mkdir -p "$keda"
        cp "$src"/config/crd/bases/keda.sh_*.yaml "$keda/"
        # The kafka scaler's source declares its trigger parameters (struct tags): the CRD
        # says only "a map of strings" of a trigger's metadata.
        cp "$src"/pkg/scalers/kafka_scaler.go "$keda/"
        chmod -R u+w "$keda"
        touch "$keda/.complete"
    fi
    echo "$dest"
}

install() {
    case "$1" in
        helm) install_helm ;;
        k8s-schemas) install_k8s_schemas ;;
        promtool) install_promtool ;;
        *)
            say "unknown tool '$1' (known: helm, k8s-schemas, promtool)"
            return 2
            ;;
    esac
}

if [ "$#" -eq 0 ]; then
    say "usage: tools/install-tools.sh TOOL... (helm, k8s-schemas, promtool)"
    exit 2
fi
mkdir -p "$tools/bin"
for tool in "$@"; do
    install "$tool"
done
