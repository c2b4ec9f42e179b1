#!/usr/bin/env bash
# Build the wheelhouse scripts/gpu-check.sh installs from on a GPU host with no network:
#
#     bash scripts/gpu-wheelhouse.sh DIR      # on a machine with PyPI access; DIR is created
#
# One binary wheel per line of scripts/gpu-check-wheels.txt, for CPython 3.12 on manylinux
# x86_64 (the host's numpy, torch, cupy and cuda-bindings are not fetched), then the total is
# checked against the 64 MiB that may be carried to the host. PYTHON chooses the pip to use.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
if (($# != 1)); then
    echo "usage: bash scripts/gpu-wheelhouse.sh DIR" >&2
    exit 2
fi
dir=$1
limit_bytes=$((64 << 20))
mkdir -p "$dir"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary :all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$dir" --requirement scripts/gpu-check-wheels.txt
total=$(du -cb "$dir"/*.whl | tail -n 1 | cut -f 1)
echo "$(find "$dir" -name '*.whl' | wc -l) wheels, $((total >> 20)) MiB in $dir"
if ((total > limit_bytes)); then
    echo "the wheelhouse is over 64 MiB: drop what the checks do not import" >&2
    exit 1
fi
