# Sourced by the benchmark scripts: starts `bud serve` and stops it by pid at exit, and makes
# the client venv the compat benchmarks use.
#
#   start_bud_serve TAG PORT LOG [serve options...]
#
# Starts target/release/bud serve on 127.0.0.1:PORT with its log in LOG, sets SERVER to its
# pid, stops it (SIGTERM, then waits) when the script exits, and returns once /v1/health
# answers 200 (the default template is ready; first use builds it: minutes). Exits naming
# TAG, with the log's tail, if the server dies or is not ready within 900 s.
start_bud_serve() {
    local tag=$1 port=$2 log=$3
    shift 3
    target/release/bud serve --port "$port" "$@" >"$log" 2>&1 &
    SERVER=$!
    trap 'if kill -0 "$SERVER" 2>/dev/null; then kill -TERM "$SERVER"; wait "$SERVER" || true; fi' EXIT
    for _ in $(seq 1800); do
        curl -sf "http://127.0.0.1:$port/v1/health" >/dev/null 2>&1 && return 0
        kill -0 "$SERVER" 2>/dev/null || { echo "[$tag] server died; log: $log" >&2; tail -20 "$log" >&2; exit 1; }
        sleep 0.5
    done
    echo "[$tag] server not ready after 900 s; log: $log" >&2
    exit 1
}

#   wait_for_template TAG PORT LOG NAME
#
# Waits (up to 1800 s) until the server started by start_bud_serve has template NAME ready
# (its first use builds and boots it: minutes); exits naming TAG if the template failed or
# the server died.
wait_for_template() {
    local tag=$1 port=$2 log=$3 name=$4
    echo "[$tag] waiting for the $name template (first use boots it: minutes; log: $log)" >&2
    for _ in $(seq 1800); do
        state=$(curl -sf "http://127.0.0.1:$port/v1/templates" 2>/dev/null | python3 -c \
            'import sys, json; print({t["name"]: t["status"] for t in json.load(sys.stdin)["templates"]}[sys.argv[1]])' \
            "$name" 2>/dev/null || true)
        [ "$state" = ready ] && return 0
        [ "$state" = failed ] && { echo "[$tag] the $name template failed; log: $log" >&2; exit 1; }
        kill -0 "$SERVER" 2>/dev/null || { echo "[$tag] server died; log: $log" >&2; tail -20 "$log" >&2; exit 1; }
        sleep 1
    done
}

#   ensure_compat_venv VENV
#
# Makes VENV with the pinned real clients of server/tests/compat/requirements.txt (PyPI)
# unless it already holds exactly those (the tests make the same venv in build/compat-venv).
ensure_compat_venv() {
    local venv=$1 reqs=server/tests/compat/requirements.txt
    if ! cmp -s "$reqs" "$venv/requirements.txt"; then
        echo "[bench] creating $venv from PyPI ($reqs)" >&2
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q -r "$reqs" >&2
        cp "$reqs" "$venv/requirements.txt"
    fi
}
