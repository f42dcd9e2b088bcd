#!/usr/bin/env bash
# The second stage of scripts/test-hwvirt.sh: bud on this machine's /dev/kvm. It runs inside
# the harness's first-level VM (QEMU, emulated AMD SVM), and equally directly on a host with
# real VMX or SVM, which is what such a host should run first (docs/platform.md):
#
#   scripts/hwvirt/stage2.sh short|full REPO BUD [JOBS]
#
# REPO is a bud checkout whose guest is built (`bud guest build`), BUD a bud binary built from
# it. short: `bud run` (a template booted and saved here, then loaded and cloned),
# the guest's CPUID (no svm/vmx), and `bud serve --verify-resets` under JOBS jobs (default
# 200) of every kind, driven and checked by scripts/hwvirt/drive.py. full: the same with the
# `bud boot` figure first, then the
# workspace suite (`cargo test --workspace --offline --no-fail-fast`; the test binaries and
# the compat venv must be built already), minus the fuzz test (cargo-fuzz builds and runs
# on the host) and the harness's own test (no QEMU inside). Every line meant for the summary
# starts with "hwvirt-stage2: " and one of RAN, PASS, FAIL, FIGURE, SKIP, NOTE. Exits 0 only if
# nothing failed. With HWVIRT_UNDER_QEMU=1 (set by the harness's init) it turns on
# BUD_TCG_TSS_QUIRK=1, a workaround for a QEMU TCG defect; never set it on real hardware.
set -uo pipefail

mode=${1:?usage: stage2.sh short|full REPO BUD [JOBS]}
repo=${2:?usage: stage2.sh short|full REPO BUD [JOBS]}
bud=${3:?usage: stage2.sh short|full REPO BUD [JOBS]}
jobs=${4:-200}
[[ $mode == short || $mode == full ]] || { echo "stage2: mode is short or full" >&2; exit 2; }

say() { echo "hwvirt-stage2: $*"; }
failures=0
pass() { say "PASS $*"; }
fail() {
  say "FAIL $*"
  failures=$((failures + 1))
}

# Seconds since $1 (an $EPOCHREALTIME), with 2 decimals.
since() {
  local now=$EPOCHREALTIME
  local us=$((${now//[^0-9]/} - ${1//[^0-9]/}))
  printf '%d.%02d' $((us / 1000000)) $((us % 1000000 / 10000))
}

say "start (mode $mode, $(uname -r))"
stage_start=$EPOCHREALTIME
work=$(mktemp -d /tmp/hwvirt-stage2.XXXXXX)
cd "$repo" || exit 2
# The host's toolchain environment (PATH, CARGO_HOME, RUSTUP_HOME), when the harness wrote it.
[[ -n ${HWVIRT_ENV:-} && -f $HWVIRT_ENV ]] && . "$HWVIRT_ENV"

# What this machine is.
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)
has_flag() { [[ " $2 " == *" $1 "* ]]; }
say "NOTE CPU: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), vendor $(grep -m1 '^vendor_id' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
l1_virt=
for f in svm vmx npt ept xsave avx avx2; do has_flag "$f" "$cpu_flags" && l1_virt+="$f "; done
say "NOTE this machine's CPU flags (of svm vmx npt ept xsave avx avx2): ${l1_virt:-none}"
kvm_module=none
for m in kvm_pvm kvm_amd kvm_intel; do
  [[ -d /sys/module/$m ]] && kvm_module=$m && break
done
params=
for p in npt nested ept; do
  [[ -r /sys/module/$kvm_module/parameters/$p ]] && params+="$p=$(</sys/module/$kvm_module/parameters/$p) "
done
say "NOTE /dev/kvm: $kvm_module ${params}"
if [[ ! -c /dev/kvm ]]; then
  fail "/dev/kvm is missing"
  exit 1
fi
python3 "$repo/scripts/hwvirt/msrs.py" || fail "reading KVM's MSR index list"
if [[ $kvm_module == kvm_pvm ]]; then
  say "NOTE this is kvm_pvm, not hardware virtualization: the run proves nothing about VMX/SVM"
fi
if [[ ${HWVIRT_UNDER_QEMU:-0} == 1 && ${HWVIRT_TSS_QUIRK:-1} == 0 ]]; then
  say "NOTE under QEMU TCG without BUD_TCG_TSS_QUIRK (asked for): jobs in restored clones are expected to crash"
elif [[ ${HWVIRT_UNDER_QEMU:-0} == 1 ]]; then
  export BUD_TCG_TSS_QUIRK=1
  say "NOTE under QEMU TCG: BUD_TCG_TSS_QUIRK=1 (TR restored as an available TSS; a QEMU defect, see docs/platform.md)"
fi

# 1. Boot to READY (first KVM_RUN to the agent's doorbell): the figure, in full mode only (the
# template that step 2 builds is the same boot, checked by its job's answer).
if [[ $mode == full ]]; then
  t=$EPOCHREALTIME
  say "RAN bud boot"
  if "$bud" --source-dir "$repo" boot >"$work/boot.log" 2>&1; then
    ready=$(grep -o 'READY [0-9.]* ms after the first KVM_RUN' "$work/boot.log" | head -1 | awk '{print $2}')
    pass "bud boot ($(since "$t") s)"
    say "FIGURE bud boot to READY: ${ready:-?} ms"
  else
    tail -20 "$work/boot.log"
    fail "bud boot"
  fi
fi

# 2. bud run: the first builds the template (boot + save); the second loads and clones it.
t=$EPOCHREALTIME
say "RAN bud run --local (builds the template)"
out=$("$bud" --source-dir "$repo" run --local -c 'print(1 + 1)' 2>"$work/run1.err")
rc=$?
if [[ $rc -eq 0 && $out == 2 ]]; then
  pass "bud run, first (template built in $(since "$t") s)"
else
  tail -20 "$work/run1.err"
  fail "bud run, first: exit $rc, stdout '$out'"
fi
t=$EPOCHREALTIME
out=$("$bud" --source-dir "$repo" run --local --timings --lang shell -c 'echo hi; exit 3' 2>"$work/run2.err")
rc=$?
if [[ $rc -eq 3 && $out == hi ]]; then
  pass "bud run, a clone of the saved template ($(since "$t") s, exit 3 as asked)"
  say "NOTE bud run --timings: $(grep -i 'clone\|total' "$work/run2.err" | tr '\n' ' ')"
else
  tail -20 "$work/run2.err"
  fail "bud run, second: exit $rc (want 3), stdout '$out' (want hi)"
fi

# 3. The guest's CPUID: no virtualization interface, whatever this machine has.
say "RAN the guest's CPU flags (bud run --lang shell -c 'grep flags /proc/cpuinfo')"
guest_flags=$("$bud" --source-dir "$repo" run --local --lang shell -c 'grep -m1 ^flags /proc/cpuinfo' 2>"$work/cpuid.err" | cut -d: -f2)
if [[ -z $guest_flags ]]; then
  tail -20 "$work/cpuid.err"
  fail "reading the guest's /proc/cpuinfo"
else
  seen=
  for f in svm vmx smx; do has_flag "$f" "$guest_flags" && seen+="$f "; done
  if [[ -z $seen ]]; then
    pass "the guest sees no svm, vmx or smx (this machine: ${l1_virt:-none})"
  else
    fail "the guest sees $seen"
  fi
  g=
  for f in xsave avx avx2; do has_flag "$f" "$guest_flags" && g+="$f "; done
  say "NOTE the guest's xsave/avx/avx2 flags: ${g:-none}"
fi

# 4. bud serve --verify-resets under every kind of job.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
say "RAN bud serve --verify-resets --port $port, $jobs jobs (scripts/hwvirt/drive.py)"
"$bud" --source-dir "$repo" serve --port "$port" --verify-resets >"$work/serve.log" 2>&1 &
serve_pid=$!
python3 "$repo/scripts/hwvirt/drive.py" "http://127.0.0.1:$port" "$jobs" --server-pid "$serve_pid"
drive_rc=$?
kill -TERM "$serve_pid" 2>/dev/null
wait "$serve_pid"
serve_rc=$?
if ((drive_rc != 0)); then
  tail -30 "$work/serve.log"
  fail "bud serve under $jobs jobs (see the driver's lines above)"
else
  pass "bud serve under $jobs jobs, every reset verified"
fi
if ((serve_rc == 0)); then
  pass "bud serve stopped cleanly on SIGTERM"
else
  tail -10 "$work/serve.log"
  fail "bud serve exited with status $serve_rc after SIGTERM"
fi
# The warm-job figure without the verification (which reads all of guest RAM per job).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# As many as the verified jobs, at most 100 (CI's short run: 30).
trivial=$((jobs < 100 ? jobs : 100))
say "RAN bud serve --port $port (no verification), $trivial trivial jobs in a row"
"$bud" --source-dir "$repo" serve --port "$port" >"$work/serve2.log" 2>&1 &
serve_pid=$!
python3 "$repo/scripts/hwvirt/drive.py" "http://127.0.0.1:$port" --latency "$trivial" --server-pid "$serve_pid"
drive_rc=$?
kill -TERM "$serve_pid" 2>/dev/null
wait "$serve_pid"
serve_rc=$?
if ((drive_rc == 0 && serve_rc == 0)); then
  pass "trivial jobs on warm VMs ($trivial in a row)"
else
  tail -20 "$work/serve2.log"
  fail "trivial jobs on warm VMs ($trivial in a row; driver $drive_rc, server exit $serve_rc)"
fi
say "FIGURE short checks: $(since "$stage_start") s"

# 5. The whole workspace suite (--full).
if [[ $mode == full ]]; then
  skips=(every_fuzz_target_runs_clean_for_its_time the_short_mode_passes_under_nested_svm)
  say "SKIP tests/fuzz.rs every_fuzz_target_runs_clean_for_its_time: cargo-fuzz instruments and fuzzes on the host; nothing in it touches KVM"
  say "SKIP tests/hwvirt.rs the_short_mode_passes_under_nested_svm: it starts this harness's QEMU (it ran above as the short checks)"
  args=()
  for s in "${skips[@]}"; do args+=(--skip "$s"); done
  t=$EPOCHREALTIME
  say "RAN cargo test --workspace --offline --no-fail-fast -- ${args[*]}"
  cargo test --workspace --offline --no-fail-fast -- "${args[@]}" >"$work/suite.log" 2>&1
  suite_rc=$?
  passed=$(grep -E '^test result:' "$work/suite.log" | awk '{s += $4} END {print s + 0}')
  failed=$(grep -E '^test result:' "$work/suite.log" | awk '{s += $6} END {print s + 0}')
  ignored=$(grep -E '^test result:' "$work/suite.log" | awk '{s += $8} END {print s + 0}')
  filtered=$(grep -E '^test result:' "$work/suite.log" | awk '{s += $12} END {print s + 0}')
  # One line per test binary: what it is and its result (the log stays in L1).
  awk '/^ *Running / { bin = $2 } /^test result:/ { sub(/^test result: /, ""); print "hwvirt-stage2: NOTE " bin ": " $0 }' "$work/suite.log"
  grep -E '^test .* \.\.\. FAILED$' "$work/suite.log" | sed 's/^/hwvirt-stage2: FAIL suite: /'
  say "FIGURE workspace suite: $passed passed, $failed failed, $ignored ignored, $filtered filtered out, $(since "$t") s"
  if ((suite_rc == 0 && failed == 0)); then
    pass "the workspace suite"
  else
    # The panics of the failed tests, for the log.
    grep -E -A12 '^---- .* stdout ----$' "$work/suite.log" | head -400
    grep -E '^error' "$work/suite.log" | head -20
    fail "the workspace suite (cargo test exit $suite_rc)"
  fi
fi

say "FIGURE stage 2: $(since "$stage_start") s"
if ((failures == 0)); then
  say "all passed"
  exit 0
fi
say "$failures check(s) failed"
exit 1
