#!/usr/bin/env bash
# The GPU benchmark on a lent device in one call (bench/README.md, "GPU").
#
#   bash bench/gpu_device.sh prepare        # here: fetch the cp312 wheels the device image lacks
#                                           # into bench/out/device-wheels/ (git-ignored), run the
#                                           # device step as a CPU dry run, print the call to make
#   bash bench/gpu_device.sh run            # there: install the carried wheels whose module is
#                                           # missing, run bench/gpu.py and the CUDA store tests,
#                                           # results into $OUT
#   bash bench/gpu_device.sh run --dry-run  # the same on this CPU (what `prepare` runs)
#
# The device image has Python 3.12 with torch and transformers but not everything the repo
# imports, and nothing can be downloaded there; so the wheels travel with the call (its `carry`)
# and are installed with that machine's own python into a throwaway --target folder put first
# on PYTHONPATH, never into its site-packages and never `pip install -e .`. The repository
# itself is used from the working tree (PYTHONPATH). Time: a lent device gives 15 minutes in
# all, machine start included, so the benchmark runs under a timeout that leaves room to rerun.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"

WHEELS_DIR="${EPD_DEVICE_WHEELS:-bench/out/device-wheels}"
DEVICE_PYTHON_VERSION=3.12
# "module distribution": carried, and installed there only when `import module` fails there.
CARRIED=(
    "blake3 blake3"                 # runtime.stores.base (digests): absent from the device image
    "pytest pytest"                 # the rest run tests/unit/test_cuda_store.py on the GPU;
    "pytest_asyncio pytest-asyncio" # without them that step is skipped and says so
    "pluggy pluggy"
    "iniconfig iniconfig"
    "pygments pygments"
    "redis redis"                   # tests/unit/test_stores.py imports redis-py (its cuda://
    "hiredis hiredis"               # run needs no Redis server)
)
PLATFORM_ARGS=(--python-version "$DEVICE_PYTHON_VERSION" --implementation cp
    --abi "cp${DEVICE_PYTHON_VERSION/./}" --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --only-binary=:all:)
BENCH_TIMEOUT_S="${EPD_GPU_TIMEOUT_S:-300}"   # the benchmark's hard limit there
BENCH_DEADLINE_S="${EPD_GPU_DEADLINE_S:-200}" # sections that would start later are skipped
TESTS_TIMEOUT_S="${EPD_GPU_TESTS_TIMEOUT_S:-45}"  # for each of the two test runs there
DRY_TESTS_TIMEOUT_S=180  # the dry run's: a loaded CI host is slower than the device
CALL_TIMEOUT_S=420                            # the device call's timeout_s: 7 of the 15 minutes
RUN_COMMAND="bash bench/gpu_device.sh run"

say() { echo "gpu_device: $*" >&2; }

local_python() {
    if [ -n "${EPD_PYTHON:-}" ]; then echo "$EPD_PYTHON"
    elif [ -x .venv/bin/python ]; then echo .venv/bin/python
    else command -v python3; fi
}

# --- prepare (here) ---------------------------------------------------------------------------

# The carried distributions pinned to the versions this checkout is tested with (unpinned when
# one is not installed here).
pinned_specs() {
    local py="$1" pair mod dist ver
    for pair in "${CARRIED[@]}"; do
        read -r mod dist <<<"$pair"
        ver="$("$py" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$dist")"
        echo "${dist}${ver:+==$ver}"
    done
}

fetch_wheels() {
    local py="$1" specs
    mapfile -t specs < <(pinned_specs "$py")
    mkdir -p "$WHEELS_DIR"
    say "fetching ${specs[*]} (cp${DEVICE_PYTHON_VERSION/./}, manylinux x86_64) into $WHEELS_DIR"
    if ! "$py" -m pip download --quiet --disable-pip-version-check --no-deps \
        "${PLATFORM_ARGS[@]}" -d "$WHEELS_DIR" "${specs[@]}"; then
        say "FAILED: pip download could not fetch the wheels (no package registry here?)"
        exit 3
    fi
}

# Each carried distribution has exactly one wheel, and a Python 3.12 pip would install them all
# (a cross-target install into a scratch folder: the same command the device runs, plus the
# target's tags).
check_wheels() {
    local py="$1" pair mod dist scratch
    local wheels=() found=()
    for pair in "${CARRIED[@]}"; do
        read -r mod dist <<<"$pair"
        mapfile -t found < <(compgen -G "$WHEELS_DIR/${dist//-/_}-*.whl" || true)
        if [ "${#found[@]}" -ne 1 ]; then
            say "FAILED: want one wheel of $dist in $WHEELS_DIR, found ${#found[@]}"
            exit 1
        fi
        wheels+=("${found[0]}")
    done
    scratch="$(mktemp -d)"
    "$py" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
        "${PLATFORM_ARGS[@]}" --target "$scratch" "${wheels[@]}"
    rm -rf "$scratch"
    say "wheels ready: $(du -sh "$WHEELS_DIR" | cut -f1) in $WHEELS_DIR"
}

dry_run() {
    local py="$1" out="${OUT:-}"
    [ -n "$out" ] || out="$(mktemp -d)"
    say "dry run of the device step on this CPU (results in $out)"
    OUT="$out" EPD_DEVICE_PYTHON="$py" bash bench/gpu_device.sh run --dry-run
    "$py" - "$out/gpu.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
bad = [s for s in ("parity", "encode", "stores", "overhead") if "error" in doc.get(s, {"error": 1})]
if bad:
    sys.exit(f"gpu_device: FAILED: the dry run's sections {bad} did not run")
EOF
}

print_call() {
    local carry="$WHEELS_DIR"
    case "$carry" in
        /*) carry="${carry#"$REPO"/}" ;;
    esac
    case "$carry" in
        /*) say "note: $WHEELS_DIR is outside the repo; carry needs bench/out/device-wheels" ;;
    esac
    echo "Run this on the lent device (the device tool's run call; the machine starts on it):"
    printf '{"command": "%s", "carry": ["%s"], "timeout_s": %d}\n' \
        "$RUN_COMMAND" "$carry" "$CALL_TIMEOUT_S"
    echo "There it installs the carried wheels whose module is missing (pip --target, no index),"
    echo "runs bench/gpu.py --json \$OUT/gpu.json (timeout ${BENCH_TIMEOUT_S} s) and the CUDA store"
    echo "tests (timeout ${TESTS_TIMEOUT_S} s), and returns gpu.json, the logs and env.txt."
    echo "Give the device back afterwards unless you rerun at once."
}

prepare() {
    local py
    py="$(local_python)"
    fetch_wheels "$py"
    check_wheels "$py"
    [ "${1:-}" = "--no-dry-run" ] || dry_run "$py"
    print_call
}

# --- run (there) ------------------------------------------------------------------------------

# Install the carried wheel of each module that does not import (one pip call). A dry run
# installs the pure Python ones anyway (into the scratch --target only), so the install command
# itself is tried.
install_missing() {
    local py="$1" site="$2" dry="$3" pair mod dist whl
    local wanted=()
    for pair in "${CARRIED[@]}"; do
        read -r mod dist <<<"$pair"
        whl="$(compgen -G "$WHEELS_DIR/${dist//-/_}-*.whl" | head -n 1 || true)"
        if PYTHONPATH="$site:$REPO" "$py" -c "import $mod" 2>/dev/null; then
            if [ "$dry" = 0 ] || [[ "$whl" != *-none-any.whl ]]; then continue; fi
        elif [ -z "$whl" ]; then
            say "missing here: $mod, and no carried wheel of $dist (run prepare and carry $WHEELS_DIR)"
            continue
        fi
        wanted+=("$whl")
    done
    [ "${#wanted[@]}" -gt 0 ] || return 0
    say "installing into $site: ${wanted[*]##*/}"
    if "$py" -m pip --version >/dev/null 2>&1; then
        "$py" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
            --target "$site" "${wanted[@]}"
    else  # no pip there: a wheel is a zip of an importable tree
        for whl in "${wanted[@]}"; do "$py" -m zipfile -e "$whl" "$site"; done
    fi
}

# Everything bench/gpu.py and the store need, imported for real; a missing module is named with
# what needs it, and the run stops there (a first GPU run must not die half-way).
check_imports() {
    local py="$1" site="$2" dry="$3"
    PYTHONPATH="$site:$REPO" "$py" - "$dry" <<'EOF'
import importlib, sys
needed = ["torch", "transformers", "numpy", "PIL", "blake3", "bench.gpu", "bench.gpu_stores",
          "gpu_workers.compute", "gpu_workers.engine", "gpu_workers.oracle", "runtime.model",
          "runtime.tokenizer", "runtime.stores.cuda",
          "transformers.models.qwen2_vl.modeling_qwen2_vl"]
missing = {}
for name in needed:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing.setdefault(exc.name, name)
for mod, by in missing.items():
    print(f"gpu_device: MISSING module {mod!r} (needed by {by}): add its wheel to CARRIED in "
          "bench/gpu_device.sh, run prepare again", file=sys.stderr)
if missing:
    sys.exit(3)
import torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB")
elif sys.argv[1] != "1":
    sys.exit("gpu_device: torch sees no CUDA device here; nothing to measure")
EOF
}

summarise() {
    local py="$1" json="$2"
    [ -s "$json" ] || { say "no $json written"; return 0; }
    "$py" - "$json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for name in ("parity", "encode", "stores", "overhead"):
    block = doc.get(name)
    if block is None:
        print(f"{name}: not reached")
    elif "error" in block or "skipped" in block:
        print(f"{name}: {block.get('error') or block.get('skipped')}")
    else:
        print(f"{name}: ok in {block.get('wall_s')} s")
parity = doc.get("parity", {})
if "all_match" in parity:
    print(f"parity all_match={parity['all_match']} mismatches={parity.get('mismatches')}")
EOF
}

run() {
    local dry=0
    [ "${1:-}" = "--dry-run" ] && dry=1
    local py out site rc tests_rc=0
    if [ "$dry" = 1 ]; then py="${EPD_DEVICE_PYTHON:-$(local_python)}"
    else py="${EPD_DEVICE_PYTHON:-python3}"; fi
    out="${OUT:?set OUT to the folder for the results}"
    if [ -n "${EPD_DEVICE_SITE:-}" ]; then site="$EPD_DEVICE_SITE"
    else
        site="$(mktemp -d)"
        # shellcheck disable=SC2064  # expanded now on purpose: $site is local to this function
        trap "rm -rf '$site'" EXIT
    fi
    mkdir -p "$out" "$site"
    local version
    version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    if [ "$dry" = 0 ] && [ "$version" != "$DEVICE_PYTHON_VERSION" ]; then
        say "warning: $py is Python $version; the carried compiled wheels are for $DEVICE_PYTHON_VERSION"
    fi
    install_missing "$py" "$site" "$dry"
    set +e
    check_imports "$py" "$site" "$dry" >"$out/env.txt" 2>&1
    rc=$?
    set -e
    cat "$out/env.txt"
    [ "$rc" = 0 ] || exit 3
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L >>"$out/env.txt" 2>&1 || true; fi

    local args=(bench/gpu.py --json "$out/gpu.json" --deadline-s "$BENCH_DEADLINE_S")
    [ "$dry" = 1 ] && args+=(--cpu-dry-run --quick)
    say "running ${args[*]} (timeout ${BENCH_TIMEOUT_S} s)"
    set +e
    PYTHONUNBUFFERED=1 PYTHONPATH="$site:$REPO" timeout -k 10 "$BENCH_TIMEOUT_S" \
        "$py" "${args[@]}" >"$out/gpu.stdout.json" 2>"$out/gpu.stderr.log"
    rc=$?
    set -e
    [ "$rc" = 124 ] && say "bench/gpu.py ran past its ${BENCH_TIMEOUT_S} s timeout; gpu.json holds what finished"
    [ "$rc" = 0 ] || tail -n 30 "$out/gpu.stderr.log" >&2
    summarise "$py" "$out/gpu.json"

    [ "$dry" = 1 ] && [ -z "${EPD_GPU_TESTS_TIMEOUT_S:-}" ] && TESTS_TIMEOUT_S="$DRY_TESTS_TIMEOUT_S"
    run_tests "$py" "$site" "$out" || tests_rc=$?
    [ "$rc" = 0 ] || exit "$rc"
    exit "$tests_rc"
}

# The store tests that need a GPU (the rest of those files runs too: they are quick): the
# cuda:// store's own, and the shared store suite on a real cuda:// (its [cuda] cases).
run_tests() {
    local py="$1" site="$2" out="$3" status=0 rc
    if ! PYTHONPATH="$site:$REPO" "$py" -c "import pytest, pytest_asyncio" 2>/dev/null; then
        say "pytest or pytest-asyncio missing: the CUDA store tests were not run"
        return 0
    fi
    local selections=("tests/unit/test_cuda_store.py" "tests/unit/test_stores.py -k cuda and not cpu")
    : >"$out/pytest.log"
    for selection in "${selections[@]}"; do
        read -r file k expr <<<"$selection"
        local args=("$file")
        [ -z "${k:-}" ] || args+=("$k" "$expr")
        say "running pytest ${args[*]} (timeout ${TESTS_TIMEOUT_S} s)"
        set +e
        PYTHONPATH="$site:$REPO" timeout -k 5 "$TESTS_TIMEOUT_S" "$py" -m pytest -q \
            -p no:cacheprovider --noconftest "${args[@]}" >>"$out/pytest.log" 2>&1
        rc=$?
        set -e
        [ "$rc" = 5 ] && rc=0  # nothing selected: no CUDA here (the dry run)
        [ "$rc" = 0 ] || status="$rc"
    done
    tail -n 20 "$out/pytest.log"
    return "$status"
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash bench/gpu_device.sh prepare [--no-dry-run] | run [--dry-run]" >&2; exit 2 ;;
esac
