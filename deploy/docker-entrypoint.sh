#!/bin/sh
# Container entrypoint of the sluice images (tini runs it as PID 1's only child).
#
#   (no arguments) or flags only   ->  sluice serve [--config $SLUICE_CONFIG_FILE] FLAGS...
#   serve FLAGS...                 ->  the same
#   anything else                  ->  run as given (`sluice convert ...`, `python ...`, `sh`)
#
# The server config is the YAML file at $SLUICE_CONFIG_FILE (default /etc/sluice/server.yaml)
# when one is mounted there; every field can also come from SLUICE_* variables, and flags win
# over both. `exec` replaces this shell, so SIGTERM from the runtime reaches the server itself
# and it drains (readiness 503, finish accepted requests within drain_timeout_s, exit).
set -eu

config="${SLUICE_CONFIG_FILE:-/etc/sluice/server.yaml}"

serve() {
    if [ -f "$config" ]; then
        exec sluice serve --config "$config" "$@"
    fi
    if [ -n "${SLUICE_CONFIG_FILE:-}" ]; then
        # An explicitly named config that is missing is a mistake, not a reason to run defaults.
        echo "docker-entrypoint: SLUICE_CONFIG_FILE=$config does not exist" >&2
        exit 64
    fi
    exec sluice serve "$@"
}

case "${1:-}" in
    "" | -*) serve "$@" ;;
    serve)
        shift
        serve "$@"
        ;;
    *) exec "$@" ;;
esac
