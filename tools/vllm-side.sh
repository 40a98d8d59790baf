#!/usr/bin/env bash
# tools/vllm-side.sh: vLLM 0.33.0's own Python code, importable on a CPU machine beside this
# project, for the tests that hold our vLLM backend and EC connector to vLLM's models and
# interfaces. Prints the PYTHONPATH entries (one line, colon-separated) to put after ours.
#
#   <cache>/wheel/vllm/...   the vLLM wheel unpacked without its compiled parts (*.so)
#   <cache>/deps/...         the pure-Python imports it needs that this project's environment
#                            lacks, at pinned versions (torch, transformers, pydantic, fastapi
#                            and the rest are this environment's)
#
# <cache> is ${EPD_SIDE_ENV_CACHE:-~/.cache/epd/side-env}/vllm-0.33.0-pyXY. Idempotent: a
# complete folder is reused (a second run takes a fraction of a second). PYTHON: the project's
# interpreter (default .venv/bin/python).
set -euo pipefail
shopt -s inherit_errexit

VLLM_VERSION=0.33.0
# What vLLM's scale-out protocol, its multimodal serde and its EC connector interface import
# beyond this project's own dependencies (found by importing them; pinned so a run is
# reproducible).
DEPS=(
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 attrs==26.1.0 cachetools==8.0.3
    cbor2==6.3.0 cloudpickle==3.1.3 frozenlist==1.8.0 msgspec==0.23.0 multidict==7.2.1
    openai-harmony==0.0.8 propcache==0.5.4 py-cpuinfo==9.0.0 pybase64==1.5.1 pyzmq==27.3.0
    yarl==1.25.1
)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python=python3
pyver="$("$python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
cache="${EPD_SIDE_ENV_CACHE:-$HOME/.cache/epd/side-env}/vllm-$VLLM_VERSION-$pyver"
say() { echo "vllm-side: $*" >&2; }

# The folder is complete when its stamp names exactly this script's pins.
stamp="vllm==$VLLM_VERSION ${DEPS[*]}"
if [ "$(cat "$cache/.complete" 2>/dev/null)" != "$stamp" ]; then
    say "assembling vLLM $VLLM_VERSION's Python code in $cache (one download, ~340 MB)"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "$python" -m pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$work/dl"
    mkdir -p "$work/wheel"
    # The compiled kernels are of no use without a GPU, and are most of the wheel's size.
    "$python" -m zipfile -e "$work"/dl/vllm-*.whl "$work/wheel"
    find "$work/wheel" -name '*.so' -delete
    "$python" -m pip install -q --no-deps --no-compile --target "$work/deps" "${DEPS[@]}"
    rm -rf "$cache"
    mkdir -p "$(dirname "$cache")"
    mv "$work" "$cache"
    trap - EXIT
    rm -rf "$cache/dl"
    echo "$stamp" > "$cache/.complete"
fi
echo "$cache/wheel:$cache/deps"
