#!/usr/bin/env bash
# HTTP load benchmark of `bud serve`: drives POST /v1/exec from a second process with `hey`
# (Debian's HTTP load generator) for a fixed number of requests at a fixed concurrency, and
# reports throughput, p50/p99 latency, failures and the server's RSS before and after.
#
#   scripts/bench-http.sh                       # print(1+1): sequential, then 1000 requests
#                                               #   at concurrency 4 and at 16
#   REQUESTS=5000 CONCURRENCIES="8" scripts/bench-http.sh
#   CODE='import json; print(json.dumps([1]))' scripts/bench-http.sh
#   SERVE_ARGS=--fresh-clones scripts/bench-http.sh   # a fresh clone per job, for comparison
#
# Steps: build the release binary; start `bud serve` on 127.0.0.1:$PORT (its pid is stopped on
# exit); wait for /v1/health; warm up; one sequential run (concurrency 1: the latency of a lone
# request) and a load run per concurrency; then compare the job counters in /metrics with the
# requests sent.
# It measures and reports; it asserts no time. It exits non-zero if any request failed.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-1000}
CONCURRENCIES=${CONCURRENCIES:-4 16}
SERVE_ARGS=${SERVE_ARGS:-}
SEQUENTIAL=${SEQUENTIAL:-200}
PORT=${PORT:-18471}
CODE=${CODE:-print(1+1)}
LOG=${LOG:-target/bench-http-server.log}

if ! command -v hey >/dev/null; then
    echo "[bench-http] installing hey (apt-get)" >&2
    apt-get update -qq && apt-get install -y -qq hey >/dev/null
fi
for tool in curl python3; do
    command -v "$tool" >/dev/null || { echo "[bench-http] needs $tool" >&2; exit 1; }
done

cargo build --release --quiet
URL="http://127.0.0.1:$PORT"
BODY=$(CODE="$CODE" python3 -c 'import json, os; print(json.dumps({"code": os.environ["CODE"]}))')

# The default queue (64 waiting jobs) holds every concurrent request of the load.
. scripts/serve-lib.sh
# shellcheck disable=SC2086 # SERVE_ARGS is a list of options
start_bud_serve bench-http "$PORT" "$LOG" $SERVE_ARGS

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$SERVER/status"; }
jobs_ok() { curl -sf "$URL/metrics" | awk '/^bud_jobs_total\{status="ok"\}/ {print $2}'; }
# Sum and count of the server-side job time (clone + run + collect), from the histogram.
job_seconds() { curl -sf "$URL/metrics" | awk '/^bud_job_total_seconds_(sum|count)/ {printf "%s ", $2} END {print ""}'; }
jobs_all() { curl -sf "$URL/metrics" | awk '/^bud_jobs_total\{/ {n += $2} END {print n + 0}'; }
run_hey() { # requests concurrency output-file
    hey -n "$1" -c "$2" -t 60 -m POST -T application/json -d "$BODY" "$URL/v1/exec" >"$3"
}
# Fields of hey's summary: requests/s, p50 and p99 (ms), non-200 responses, transport errors.
summarize() {
    python3 - "$1" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
def pct(p):
    # hey prints seconds with 4 decimals: 0.1 ms resolution.
    m = re.search(r"\s%d%%+ in ([\d.]+) secs" % p, text)
    if not m:
        return "n/a"
    ms = float(m.group(1)) * 1e3
    return f"{ms:.1f}" if ms > 0 else "<0.1"
codes = {int(c): int(n) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", text)}
err_block = text.split("Error distribution:")[1] if "Error distribution:" in text else ""
errors = sum(int(n) for n in re.findall(r"^\s+\[(\d+)\]", err_block, re.M))
non200 = sum(n for c, n in codes.items() if c != 200)
print(f"{rps:.1f} {pct(50)} {pct(99)} {non200} {errors} {codes.get(200, 0)}")
EOF
}

echo "[bench-http] warm-up" >&2
run_hey 50 2 /dev/null
sleep 1
RSS_BEFORE=$(rss_kib)
OK_BEFORE=$(jobs_ok)
ALL_BEFORE=$(jobs_all)

echo "[bench-http] sequential: $SEQUENTIAL requests, concurrency 1" >&2
SEQ_OUT=$(mktemp)
read -r SUM0 COUNT0 < <(job_seconds)
run_hey "$SEQUENTIAL" 1 "$SEQ_OUT"
read -r SUM1 COUNT1 < <(job_seconds)
read -r SEQ_RPS SEQ_P50 SEQ_P99 SEQ_NON200 SEQ_ERR SEQ_200 < <(summarize "$SEQ_OUT")
SEQ_JOB_MS=$(python3 -c "print(f'{($SUM1 - $SUM0) * 1e3 / max(1, $COUNT1 - $COUNT0):.2f}')")

echo "[bench-http] HTTP floor: $SEQUENTIAL x GET /v1/health, concurrency 1" >&2
FLOOR_OUT=$(mktemp)
hey -n "$SEQUENTIAL" -c 1 "$URL/v1/health" >"$FLOOR_OUT"
read -r _ FLOOR_P50 _ FLOOR_NON200 FLOOR_ERR _ < <(summarize "$FLOOR_OUT")

LOAD_LINES=""
NON200=0
ERR=0
for CONCURRENCY in $CONCURRENCIES; do
    echo "[bench-http] load: $REQUESTS requests, concurrency $CONCURRENCY" >&2
    LOAD_OUT=$(mktemp)
    run_hey "$REQUESTS" "$CONCURRENCY" "$LOAD_OUT"
    read -r RPS P50 P99 L_NON200 L_ERR _ < <(summarize "$LOAD_OUT")
    NON200=$((NON200 + L_NON200))
    ERR=$((ERR + L_ERR))
    LOAD_LINES="${LOAD_LINES}  load ($REQUESTS requests, concurrency $CONCURRENCY): ${RPS} req/s, p50 ${P50} ms, p99 ${P99} ms
"
    rm -f "$LOAD_OUT"
done

sleep 2 # let the reaper close the last clones
RSS_AFTER=$(rss_kib)
OK_DELTA=$(( $(jobs_ok) - OK_BEFORE ))
ALL_DELTA=$(( $(jobs_all) - ALL_BEFORE ))
FAILED=$(( SEQ_NON200 + SEQ_ERR + FLOOR_NON200 + FLOOR_ERR + NON200 + ERR + ALL_DELTA - OK_DELTA ))

cat <<EOF
bud HTTP benchmark: POST /v1/exec $BODY
  host: $(nproc) cores; server: bud serve --port $PORT $SERVE_ARGS (pid $SERVER)
  sequential ($SEQUENTIAL requests, concurrency 1): ${SEQ_RPS} req/s, p50 ${SEQ_P50} ms, p99 ${SEQ_P99} ms;
    mean server-side job time (clone + run + collect) ${SEQ_JOB_MS} ms: the rest is HTTP and queueing;
    HTTP floor (GET /v1/health, no job): p50 ${FLOOR_P50} ms
${LOAD_LINES}  failures: $FAILED (non-200 $((SEQ_NON200 + NON200)), transport errors $((SEQ_ERR + ERR)), jobs not ok $((ALL_DELTA - OK_DELTA)) of $ALL_DELTA)
  server RSS: before ${RSS_BEFORE} KiB, after ${RSS_AFTER} KiB ($(( (RSS_AFTER - RSS_BEFORE) )) KiB)
EOF
rm -f "$SEQ_OUT" "$FLOOR_OUT"
[ "$FAILED" -eq 0 ]
