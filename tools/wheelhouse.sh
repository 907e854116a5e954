#!/usr/bin/env bash
# The wheels `make gpu-check` (and pre-training) needs beyond a CUDA PyTorch image, for a GPU machine
# without network: build them here, copy the folder there, run tools/offline_gpu_check.sh there.
#
#   tools/wheelhouse.sh DEST [PYTHON_VERSION]        # e.g. tools/wheelhouse.sh .whl 3.12
#
# DEST gets: deepspeed (built from its source release here, DS_BUILD_OPS=0: its CUDA ops, which
# this project does not use, would compile on first use there), megatron-core, and the small
# packages deepspeed needs that a PyTorch image usually lacks (hjson, pydantic and its own needs),
# as manylinux x86_64 wheels for PYTHON_VERSION (default: the target's usual 3.12). Versions are
# pyproject.toml's pins. torch, numpy, transformers, tokenizers, safetensors, xxhash, psutil, tqdm
# and pytest are expected there already (docs/gpu.md, "On a GPU machine without network").
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: tools/wheelhouse.sh DEST [PYTHON_VERSION]" >&2; exit 2; }
dest=$1
python_version=${2:-3.12}
[[ $python_version =~ ^3\.[0-9]+$ ]] || { echo "PYTHON_VERSION $python_version: give it as 3.N, e.g. 3.12" >&2; exit 2; }
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
pin() {  # the version pyproject.toml pins for package $1
    sed -n "s/^ *\"$1==\([0-9.]*\)\".*/\1/p" pyproject.toml
}
deepspeed_version=$(pin deepspeed)
megatron_version=$(pin megatron-core)
[ -n "$deepspeed_version" ] && [ -n "$megatron_version" ] || {
    echo "pyproject.toml pins no deepspeed==X or megatron-core==X" >&2; exit 2; }
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
# A pure-python wheel: the same for every Python 3 and platform.
DS_BUILD_OPS=0 "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$dest" "deepspeed==$deepspeed_version"
# megatron-core without its needs (torch, numpy, packaging are there); pydantic with its own.
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp "${platforms[@]}" -d "$dest" "megatron-core==$megatron_version" hjson
"$python" -m pip download --quiet --only-binary=:all: --python-version "$python_version" \
    --implementation cp "${platforms[@]}" -d "$dest" "pydantic>=2"
# typing-extensions comes with pydantic; the image has one and two copies would both install.
rm -f "$dest"/typing_extensions-*.whl
ls -1 "$dest"
du -sh "$dest"
