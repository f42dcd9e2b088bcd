#!/usr/bin/env bash
# bud on hardware virtualization, tested on a machine without it: QEMU's TCG emulates an AMD
# CPU with SVM and nested paging, a first-level VM (L1) runs Debian's 6.1 kernel with
# kvm_amd (npt=1 nested=1), and bud runs inside it on that /dev/kvm (its guests are L2).
#
# Usage: scripts/test-hwvirt.sh [--full] [--jobs N] [--keep-log]
#   (default)  the short mode, for CI: L1 boot; `bud boot`; `bud run`; the guest's CPUID has
#              no svm/vmx; `bud serve --verify-resets` under N jobs (default 200) of every kind
#              (python, shell, errors, timeout, memory limit, output cap, files, a batch,
#              sessions with files and forks) with every answer checked and no reset failing
#              its verification. Prints what ran, what passed, and the figures.
#   --full     the whole workspace suite inside L1 (`cargo test --workspace --no-fail-fast`,
#              minus the fuzz test and this harness's own test), after building the test
#              binaries and the compat tests' client venv on this host (L1 has no network).
# Exits non-zero if anything failed.
#
# Environment:
#   BUD=PATH          the bud binary to test (default: `cargo build --release`, target/release/bud)
#   HWVIRT_DIR=DIR    cache of QEMU's inputs (default: build/hwvirt)
#   HWVIRT_TIMEOUT_S  give up on L1 after this long (default: 1200 short, 7200 full)
#   HWVIRT_TSS_QUIRK=0  run without BUD_TCG_TSS_QUIRK, to see the QEMU defect (jobs crash)
#
# What it prepares, once, cached under HWVIRT_DIR (build/ is ignored by git): the package
# qemu-system-x86 (installed with apt-get, as root), the Debian kernel package that
# linux-image-amd64 depends on and busybox-static (fetched with `apt-get download`, unpacked
# with `dpkg-deb -x`, never installed), and a small initramfs (busybox, the modules for
# virtio, 9p, overlayfs and kvm_amd, scripts/hwvirt/init). L1 mounts this host's root
# read-only over 9p with a tmpfs overlay for its writes, and runs scripts/hwvirt/stage2.sh in
# a chroot of it: that script is the second stage, which a machine with real VMX or SVM runs
# directly on its own /dev/kvm, without QEMU (docs/platform.md).
#
# QEMU's TCG has a defect that the harness works around: it refuses user-mode port I/O when
# TR's cached type is busy, which KVM on AMD reports and bud restores; stage 2 sets
# BUD_TCG_TSS_QUIRK=1 when it runs under QEMU (see vmm/src/snapshot.rs).
set -Eeuo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly repo
start=$EPOCHREALTIME

die() {
  echo "hwvirt: error: $*" >&2
  exit 1
}

# Microseconds since the script started (digits only: the radix follows the locale).
elapsed_us() {
  local now=$EPOCHREALTIME
  echo $((${now//[^0-9]/} - ${start//[^0-9]/}))
}

step() {
  local us
  us=$(elapsed_us)
  printf 'hwvirt: [%4d.%ds] %s\n' $((us / 1000000)) $((us % 1000000 / 100000)) "$*"
}

trap 'echo "hwvirt: error: \"$BASH_COMMAND\" failed (line $LINENO)" >&2' ERR

mode=short
jobs=200
while [[ $# -gt 0 ]]; do
  case $1 in
    --full) mode=full ;;
    --jobs)
      [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || die "--jobs wants a positive number"
      jobs=$2
      shift
      ;;
    -h | --help)
      sed -n '2,/^set -E/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done

[[ $(uname -m) == x86_64 ]] || die "this harness emulates an x86_64 AMD CPU on an x86_64 host"
[[ $EUID -eq 0 ]] || die "run as root: it installs QEMU with apt-get and exports / to the VM"

cache=${HWVIRT_DIR:-$repo/build/hwvirt}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
readonly cache
build_lock=$repo/build/build.lock

# bud's first-use build steps take turns under build/build.lock (guest/src/lock.rs); so do
# this harness's installs and downloads. The holder's name goes into the file for waiters.
lock_builds() {
  exec {lock_fd}<>"$build_lock"
  if ! flock -n "$lock_fd"; then
    step "waiting for $(tr -d '\n' <"$build_lock" 2>/dev/null || true) to finish"
    flock "$lock_fd"
  fi
  printf 'the hwvirt harness (%s) (pid %d)\n' "$1" $$ >"$build_lock"
}

unlock_builds() {
  : >"$build_lock"
  flock -u "$lock_fd"
  exec {lock_fd}>&-
}

# apt-get, non-interactive, waiting up to 10 min for another apt run's locks: installs and
# downloads through DPkg::Lock::Timeout, `update` (whose lists lock ignores that option in
# Debian 12's apt) by retrying while apt says a lock is held. As scripts/build-kernel.sh.
apt_updated=0
apt_update() {
  ((apt_updated)) && return 0
  local waited=0 log
  log=$(mktemp)
  until DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null 2>&1 | tee "$log"; [[ ${PIPESTATUS[0]} -eq 0 ]]; do
    grep -q "Could not get lock" "$log" && ((waited < 600)) || {
      rm -f "$log"
      die "apt-get update failed"
    }
    step "another apt run holds apt's lock; waiting for it"
    sleep 2
    waited=$((waited + 2))
  done
  rm -f "$log"
  apt_updated=1
}

apt_get() {
  DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600 "$@" </dev/null
}

# Runs apt-get "$@"; when it fails and the lists were not refreshed yet, refreshes them and
# tries once more (a clean machine's lists may be missing or stale).
apt_retry() {
  apt_get "$@" && return 0
  ((apt_updated)) && return 1
  step "apt-get $* failed; refreshing the package lists and trying again"
  apt_update
  apt_get "$@"
}

# Installs package $2 when program $1 is missing.
need_tool() {
  command -v "$1" >/dev/null && return 0
  step "installing $2 (for $1)"
  apt_retry install -y --no-install-recommends "$2" || die "apt-get install $2 failed"
}

install_qemu() {
  command -v qemu-system-x86_64 >/dev/null && return 0
  step "installing qemu-system-x86 (apt-get)"
  apt_retry install -y --no-install-recommends qemu-system-x86 ||
    die "apt-get install qemu-system-x86 failed"
  command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 still missing"
}

# The package linux-image-amd64 depends on (linux-image-<abi>-amd64): Debian's current 6.1.
kernel_package() {
  local pkg
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
    awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
  if [[ -z $pkg ]]; then
    apt_update >&2
    pkg=$(apt-cache depends linux-image-amd64 |
      awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
  fi
  [[ -n $pkg ]] || die "cannot tell which kernel package linux-image-amd64 depends on"
  echo "$pkg"
}

# Fetches package $1 with `apt-get download` and unpacks it into $2 (kept once done).
fetch_unpacked() {
  local pkg=$1 dest=$2 tmp deb
  [[ -f $dest/.done ]] && return 0
  step "fetching $pkg (apt-get download, dpkg-deb -x)"
  tmp=$(mktemp -d "$cache/download.XXXXXX")
  (cd "$tmp" && apt_retry -o APT::Sandbox::User=root download "$pkg") || die "apt-get download $pkg failed"
  deb=$(find "$tmp" -maxdepth 1 -name '*.deb' | head -1)
  [[ -n $deb ]] || die "apt-get download $pkg left no .deb"
  rm -rf "$dest"
  mkdir -p "$dest"
  dpkg-deb -x "$deb" "$dest" || die "dpkg-deb -x $deb failed"
  basename "$deb" >"$dest/.done"
  rm -rf "$tmp"
}

# The modules L1 loads, in load order, with their dependencies first.
readonly MODULES=(virtio_pci 9pnet_virtio 9p overlay kvm_amd)

# Module name (dashes as underscores) -> its file, relative to the modules directory.
declare -A module_file=()
index_modules() {
  local f n
  while IFS= read -r f; do
    n=${f##*/}
    n=${n%%.ko*}
    module_file[${n//-/_}]=$f
  done < <(cd "$moddir" && find kernel -name '*.ko*')
}

# A module's dependencies, from its .modinfo section (the package ships no modules.dep:
# depmod makes it at install time).
module_depends() {
  local f=$moddir/$1 tmp
  tmp=$(mktemp)
  case $f in
    *.ko) cp "$f" "$tmp" ;;
    *.ko.xz) xz -dc "$f" >"$tmp" ;;
    *.ko.zst) zstd -dqc "$f" >"$tmp" ;;
    *) die "unexpected module file $f" ;;
  esac
  objcopy -O binary --only-section=.modinfo "$tmp" /dev/stdout | tr '\0' '\n' |
    sed -n 's/^depends=//p' | tr ',' ' '
  rm -f "$tmp"
}

# Appends to $load_order the files of module $1 and everything it needs, each after its
# dependencies, none twice.
load_order=()
declare -A seen=()
resolve_module() {
  local name=${1//-/_} f d
  f=${module_file[$name]:-}
  if [[ -z $f ]]; then
    # Built into this kernel: nothing to load.
    grep -q "/${name}.ko\$\|/${name//_/-}.ko\$" "$moddir/modules.builtin" && return 0
    die "module $1 is neither a file of $kpkg nor built into it"
  fi
  [[ -n ${seen[$f]:-} ]] && return 0
  for d in $(module_depends "$f"); do
    resolve_module "$d"
  done
  [[ -n ${seen[$f]:-} ]] && return 0
  seen[$f]=1
  load_order+=("$f")
}

build_initramfs() {
  local key want root m mods=() line f
  want=$( {
    echo "kernel $kpkg $(<"$kdir/.done")"
    echo "busybox $(<"$bbdir/.done")"
    echo "modules ${MODULES[*]}"
    cat "$repo/scripts/hwvirt/init" "${BASH_SOURCE[0]}"
  } | sha256sum | cut -d' ' -f1)
  if [[ -f $cache/initramfs.key && $(<"$cache/initramfs.key") == "$want" && -f $cache/initramfs.cpio ]]; then
    return 0
  fi
  step "building the L1 initramfs"
  need_tool cpio cpio
  need_tool objcopy binutils
  root=$(mktemp -d "$cache/initramfs.XXXXXX")
  mkdir -p "$root"/{bin,dev,proc,sys,lower,rw,newroot,modules}
  cp "$bbdir/bin/busybox" "$root/bin/busybox"
  ln -s busybox "$root/bin/sh"
  install -m 755 "$repo/scripts/hwvirt/init" "$root/init"
  index_modules
  for m in "${MODULES[@]}"; do resolve_module "$m"; done
  mods=("${load_order[@]}")
  : >"$root/modules/order"
  for line in "${mods[@]}"; do
    f=${line##*/}
    case $f in
      *.ko) cp "$moddir/$line" "$root/modules/$f" ;;
      *.ko.xz) xz -dc "$moddir/$line" >"$root/modules/${f%.xz}" ;;
      *.ko.zst) zstd -dqc "$moddir/$line" >"$root/modules/${f%.zst}" ;;
      *) die "unexpected module file $line" ;;
    esac
    echo "${f%.ko*}.ko" >>"$root/modules/order"
  done
  (cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) >"$cache/initramfs.cpio.tmp"
  mv "$cache/initramfs.cpio.tmp" "$cache/initramfs.cpio"
  rm -rf "$root"
  echo "$want" >"$cache/initramfs.key"
  step "initramfs: $(du -k "$cache/initramfs.cpio" | cut -f1) KiB; modules: ${mods[*]##*/}"
}

# --- 1. This host: QEMU, kernel, busybox, initramfs, bud and its guest ---------------------

lock_builds "preparing QEMU, kernel and initramfs"
install_qemu
kpkg=$(kernel_package)
kdir=$cache/$kpkg
bbdir=$cache/busybox-static
fetch_unpacked "$kpkg" "$kdir"
fetch_unpacked busybox-static "$bbdir"
kver=${kpkg#linux-image-}
moddir=$kdir/lib/modules/$kver
vmlinuz=$kdir/boot/vmlinuz-$kver
[[ -f $vmlinuz && -d $moddir/kernel ]] || die "$kpkg has no vmlinuz-$kver or modules"
build_initramfs
unlock_builds

if [[ -z ${BUD:-} ]]; then
  step "building bud (cargo build --release)"
  (cd "$repo" && cargo build --release -q) || die "cargo build --release failed"
  BUD=$repo/target/release/bud
fi
BUD=$(realpath "$BUD")
[[ -x $BUD ]] || die "BUD=$BUD is not an executable"
case $BUD in
  "$repo"/*) ;; # the checkout stays visible in L1 wherever it is (scripts/hwvirt/init)
  /tmp/* | /run/* | /dev/* | /proc/* | /sys/*)
    die "BUD=$BUD: L1 mounts its own /tmp, /run, /dev, /proc and /sys; put bud elsewhere" ;;
esac
step "bringing the guest up to date on this host ($BUD guest build)"
"$BUD" --source-dir "$repo" guest build >"$cache/guest-build.log" 2>&1 ||
  die "bud guest build failed: $(tail -5 "$cache/guest-build.log")"

if [[ $mode == full ]]; then
  step "building the test binaries on this host (cargo test --workspace --no-run)"
  (cd "$repo" && cargo test --workspace --no-run -q 2>&1 | tail -3) ||
    die "cargo test --workspace --no-run failed"
  reqs=$repo/server/tests/compat/requirements.txt
  venv=$repo/build/compat-venv
  if ! cmp -s "$reqs" "$venv/requirements.txt" || [[ ! -x $venv/bin/python ]]; then
    lock_builds "the compat client venv"
    if ! cmp -s "$reqs" "$venv/requirements.txt" || [[ ! -x $venv/bin/python ]]; then
      step "making the compat tests' client venv on this host (L1 has no network)"
      rm -rf "$venv"
      python3 -m venv "$venv" && "$venv/bin/python" -m pip install -q -r "$reqs" ||
        die "making $venv failed"
      cp "$reqs" "$venv/requirements.txt"
    fi
    unlock_builds
  fi
fi

# --- 2. L1: QEMU with TCG, an emulated EPYC with SVM and nested paging ----------------------

timeout_s=${HWVIRT_TIMEOUT_S:-$([[ $mode == full ]] && echo 7200 || echo 1200)}
log=$cache/$mode.log
# The host's toolchain for stage 2 (cargo in --full), as a file it sources.
envfile=$cache/env
{
  printf 'export PATH=%q\n' "$PATH"
  for v in CARGO_HOME RUSTUP_HOME RUSTUP_TOOLCHAIN; do
    [[ -n ${!v:-} ]] && printf 'export %s=%q\n' "$v" "${!v}"
  done
} >"$envfile"
cmdline="console=ttyS0 quiet panic=-1 hwvirt.mode=$mode hwvirt.repo=$repo hwvirt.bud=$BUD"
cmdline+=" hwvirt.jobs=$jobs hwvirt.tcg=1 hwvirt.quirk=${HWVIRT_TSS_QUIRK:-1} hwvirt.env=$envfile"
qemu=(qemu-system-x86_64 -machine q35,accel=tcg -cpu EPYC,+svm,+npt -smp 1 -m 4G
  -nographic -no-reboot -nic none -monitor none -serial stdio
  -kernel "$vmlinuz" -initrd "$cache/initramfs.cpio" -append "$cmdline"
  -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
step "starting L1: ${qemu[*]}"
echo "hwvirt: the console of L1 follows (also in $log)"

qemu_start=$(elapsed_us)
l1_boot_us=
result=
# QEMU's stdin is not the terminal (a console on stdin would take ^C as input).
exec {qemu_out}< <(timeout --kill-after=10 "$timeout_s" "${qemu[@]}" </dev/null 2>&1; echo "HWVIRT-QEMU-EXIT $?")
: >"$log"
summary=()
while IFS= read -r line <&"$qemu_out"; do
  line=${line%$'\r'}
  printf '%s\n' "$line" >>"$log"
  case $line in
    # (SeaBIOS's screen clearing may come first on the line.)
    *"hwvirt-stage2: start"*)
      line="hwvirt-stage2: start${line#*hwvirt-stage2: start}"
      [[ -z $l1_boot_us ]] && l1_boot_us=$(($(elapsed_us) - qemu_start))
      ;;
    "HWVIRT-RESULT "*) result=${line#HWVIRT-RESULT } ;;
    "HWVIRT-QEMU-EXIT "*)
      qemu_rc=${line#HWVIRT-QEMU-EXIT }
      continue
      ;;
  esac
  case $line in
    "hwvirt-stage2: "* | "HWVIRT-"*) summary+=("$line") ;;
  esac
  printf '  | %s\n' "$line"
done
exec {qemu_out}<&-
total_us=$(elapsed_us)

echo
echo "hwvirt: ===== summary ($mode mode) ====="
printf '%s\n' "${summary[@]}" | grep -E "^hwvirt-stage2: (RAN|PASS|FAIL|FIGURE|SKIP|NOTE)" || true
if [[ -n $l1_boot_us ]]; then
  printf 'hwvirt: FIGURE first-level VM boot (QEMU start to stage 2 in L1): %d.%02d s\n' \
    $((l1_boot_us / 1000000)) $((l1_boot_us % 1000000 / 10000))
fi
printf 'hwvirt: FIGURE the whole run (preparation included): %d.%01d s\n' \
  $((total_us / 1000000)) $((total_us % 1000000 / 100000))
case ${qemu_rc:-} in
  0) ;;
  124 | 137) echo "hwvirt: FAIL L1 did not finish within ${timeout_s} s (HWVIRT_TIMEOUT_S)" ;;
  *) echo "hwvirt: FAIL QEMU exited with status ${qemu_rc:-unknown}" ;;
esac
if [[ ${qemu_rc:-} == 0 && $result == "rc=0" ]]; then
  echo "hwvirt: PASSED ($mode mode)"
  exit 0
fi
echo "hwvirt: FAILED ($mode mode): stage 2 ${result:-never reported a result}; console in $log"
exit 1
