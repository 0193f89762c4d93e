# shellcheck shell=bash disable=SC2034  # sourced by guest-e2e.sh, which reads the DISK_* variables
# Helpers shared by the disk providers of guest-e2e.sh (sourced before the provider).

# provider_wait_sock SOCK PID LOG [TRIES]: waits (TRIES x 50 ms, default 100) for the unix socket
# SOCK of the server PID; if it does not appear or the server dies, prints the end of LOG and fails.
provider_wait_sock() {
    local i
    for i in $(seq "${4:-100}"); do
        [ -S "$1" ] && return 0
        kill -0 "$2" 2>/dev/null || break
        sleep 0.05
    done
    echo "$1 did not appear; log $3:" >&2
    tail -n 30 "$3" >&2
    return 1
}

# provider_term PID: SIGTERM to the server PID (if it still runs) and wait for it.
provider_term() {
    if [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; then
        kill -TERM "$1"
        wait "$1" 2>/dev/null || true
    fi
}

# Called once at the end of the run (EXIT trap); providers with long-lived daemons override it.
provider_shutdown() { :; }
