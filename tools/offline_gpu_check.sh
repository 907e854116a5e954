#!/usr/bin/env bash
# `make gpu-check` on a GPU machine without network, from the repository's root there:
#
#   tools/offline_gpu_check.sh WHEELHOUSE ARCHIVE [tools/gpu_check.py flags...]
#   tools/offline_gpu_check.sh .whl /tmp/gpu-check.tar.gz --budget-seconds 480
#
# Installs WHEELHOUSE/*.whl (tools/wheelhouse.sh) into a private folder (never into the machine's
# Python), puts it and this checkout on PYTHONPATH, and runs tools/gpu_check.py with
# `--archive ARCHIVE`: the whole results folder in one file, written also when the check is
# stopped. The sample data for pretrain's step is read from shared/data inside the checkout (copy
# ../shared/data there first) or ../shared/data beside it.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: tools/offline_gpu_check.sh WHEELHOUSE ARCHIVE [gpu_check flags...]" >&2; exit 2; }
wheelhouse=$1 archive=$2
shift 2
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
shopt -s nullglob
wheels=("$wheelhouse"/*.whl)
[ ${#wheels[@]} -gt 0 ] || { echo "WHEELHOUSE $wheelhouse: no .whl files (tools/wheelhouse.sh builds them)" >&2; exit 2; }
site=${PMLM_SITE:-${TMPDIR:-/tmp}/megatron-pmlm-site}
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -c "import deepspeed, megatron.core, megatron_pmlm" || {
    echo "the wheelhouse does not make deepspeed, megatron.core and megatron_pmlm import (above)" >&2; exit 1; }
exec "$python" tools/gpu_check.py --archive "$archive" "$@"
