#!/usr/bin/env bash
# Build bud's guest kernel: Debian's linux-source-6.12, our patches
# (guest/kernel/patches), our config fragment (guest/kernel/bud.config) on top
# of allnoconfig. The result is the uncompressed ELF OUT_DIR/vmlinux that the
# VMM boots directly.
#
# Usage: scripts/build-kernel.sh OUT_DIR
#
# OUT_DIR/key is the sha256 of the source package version, the fragment, the
# patches and this script; when it matches, the build is skipped. The tree in
# OUT_DIR/src is reused (make is incremental) while the package version and
# the patches are unchanged, and re-extracted otherwise. Every step can be
# interrupted and re-run. Needs root only to install missing packages.
set -Eeuo pipefail

readonly SRC_PKG=linux-source-6.12
readonly TARBALL=/usr/src/linux-source-6.12.tar.xz
# What extracting, patching, configuring and `make vmlinux` need.
# libc6-dev is only a Recommends of gcc, but the host tools need its headers.
readonly DEPS=("$SRC_PKG" flex bison bc libelf-dev libssl-dev make gcc
  libc6-dev xz-utils patch)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly repo
readonly script="${BASH_SOURCE[0]}"
readonly fragment="$repo/guest/kernel/bud.config"
readonly patch_dir="$repo/guest/kernel/patches"

start=$EPOCHREALTIME

die() {
  echo "kernel: error: $*" >&2
  exit 1
}

# One progress line per step, with the seconds since the script started.
step() {
  local now=$EPOCHREALTIME
  # Digits only: the radix character of EPOCHREALTIME follows the locale.
  local us=$((${now//[^0-9]/} - ${start//[^0-9]/}))
  printf 'kernel: [%4d.%ds] %s\n' $((us / 1000000)) $((us % 1000000 / 100000)) "$*"
}

usage() {
  echo "usage: $0 OUT_DIR" >&2
  exit 2
}

# Anything that fails without its own message still says what and where.
trap 'echo "kernel: error: \"$BASH_COMMAND\" failed (line $LINENO)" >&2' ERR

[[ $# -eq 1 && -n $1 ]] || usage
[[ $(uname -m) == x86_64 ]] || die "the guest kernel is built natively on x86_64 (this is $(uname -m))"
mkdir -p "$1"
out=$(cd "$1" && pwd)
readonly out
readonly src="$out/src"
readonly log="$out/build.log"
trap 'rm -f "$out/vmlinux.tmp" "$out/key.tmp"' EXIT

install_deps() {
  local missing=() have p
  # One dpkg call for all packages keeps the up-to-date path fast.
  have=$(dpkg -s "${DEPS[@]}" 2>/dev/null |
    awk '/^Package:/ { p = $2 } /^Status: .* ok installed$/ { print p }') || true
  for p in "${DEPS[@]}"; do
    grep -qxF "$p" <<<"$have" || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0

  [[ $EUID -eq 0 ]] || die "missing packages (${missing[*]}); run as root or install them"
  step "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # bud's own builds take turns under build/build.lock; an apt run outside bud is waited
  # for: install through DPkg::Lock::Timeout, update (whose lists lock ignores that option
  # in Debian 12's apt) by retrying while apt reports a held lock.
  local waited=0 apt_log
  apt_log=$(mktemp)
  until apt-get update -q </dev/null 2>&1 | tee "$apt_log"; [[ ${PIPESTATUS[0]} -eq 0 ]]; do
    grep -q "Could not get lock" "$apt_log" && ((waited < 600)) || {
      rm -f "$apt_log"
      die "apt-get update failed"
    }
    step "another apt run holds apt's lock; waiting for it"
    sleep 2
    waited=$((waited + 2))
  done
  rm -f "$apt_log"
  apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 "${missing[@]}" </dev/null ||
    die "apt-get install ${missing[*]} failed"
}

patches=()
collect_patches() {
  local p
  shopt -s nullglob
  for p in "$patch_dir"/*.patch; do patches+=("$p"); done
  shopt -u nullglob
  # The glob is already sorted; sort again in the C locale so the order
  # (and the key) does not depend on the caller's locale.
  if [[ ${#patches[@]} -gt 0 ]]; then
    mapfile -t patches < <(printf '%s\n' "${patches[@]}" | LC_ALL=C sort)
  fi
}

# sha256 of the source package version and the patches: what the tree holds.
tree_key() {
  {
    echo "package $SRC_PKG $pkg_version"
    local p
    for p in "${patches[@]}"; do
      echo "patch ${p##*/}"
      cat "$p"
    done
  } | sha256sum | cut -d' ' -f1
}

# sha256 of everything the kernel depends on: the tree, the fragment, this script.
build_key() {
  {
    echo "tree $(tree_key)"
    echo "config"
    cat "$fragment"
    echo "script"
    cat "$script"
  } | sha256sum | cut -d' ' -f1
}

prepare_tree() {
  local want
  want=$(tree_key)
  if [[ -f $src/.bud-tree-key && $(<"$src/.bud-tree-key") == "$want" ]]; then
    step "reusing source tree $src"
    return 0
  fi
  step "extracting $SRC_PKG $pkg_version into $src"
  rm -rf "$src"
  mkdir -p "$src"
  tar -xf "$TARBALL" -C "$src" --strip-components=1 || die "extracting $TARBALL failed"
  local p
  for p in "${patches[@]}"; do
    step "applying ${p##*/}"
    patch -d "$src" -p1 --forward --batch --fuzz=0 --no-backup-if-mismatch -s <"$p" ||
      die "patch ${p##*/} does not apply to $SRC_PKG $pkg_version"
  done
  # Written last: a tree without it is incomplete and gets re-extracted.
  echo "$want" >"$src/.bud-tree-key"
}

# The fragment as two parallel lists; fails on a line it cannot parse or an
# option listed twice (Kconfig would silently take the last one).
frag_names=()
frag_values=()
read_fragment() {
  local line
  local -A seen=()
  while IFS= read -r line || [[ -n $line ]]; do
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.+)$ ]] ||
      die "cannot parse this line of $fragment: $line"
    [[ -z ${seen[${BASH_REMATCH[1]}]-} ]] ||
      die "${BASH_REMATCH[1]} is listed twice in $fragment"
    seen[${BASH_REMATCH[1]}]=1
    frag_names+=("${BASH_REMATCH[1]}")
    frag_values+=("${BASH_REMATCH[2]}")
  done <"$fragment"
}

# Every line of the fragment must hold in the final .config: "=n" means "is
# not set" (or absent because its dependencies are off), anything else must
# appear verbatim. Kconfig silently drops what it cannot honour, so this is
# where a typo or an unmet dependency shows up.
verify_config() {
  local line name want got i bad=0
  local -A have=() known=()
  while IFS= read -r line; do
    if [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.*)$ ]]; then
      have[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
    elif [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
      have[${BASH_REMATCH[1]}]=n
    fi
  done <"$src/.config"

  for i in "${!frag_names[@]}"; do
    name=${frag_names[i]}
    want=${frag_values[i]}
    got=${have[$name]-absent}
    if [[ $got == "$want" ]]; then
      continue
    elif [[ $want == n && $got == absent ]]; then
      # Absent means off, but only for an option that exists: catch typos.
      if [[ ${#known[@]} -eq 0 ]]; then
        while read -r _ line; do known[CONFIG_$line]=1; done < <(
          find "$src" -name 'Kconfig*' -type f -exec \
            grep -hoE '^[[:space:]]*(menu)?config[[:space:]]+[A-Za-z0-9_]+' {} +)
      fi
      [[ -n ${known[$name]-} ]] && continue
      echo "kernel: config: $name=n, but $SRC_PKG has no option $name" >&2
    elif [[ $got == absent ]]; then
      echo "kernel: config: $name should be $want, but it is not in the .config (unmet dependency?)" >&2
    else
      echo "kernel: config: $name should be $want, but the .config has $name=$got" >&2
    fi
    bad=1
  done
  [[ $bad -eq 0 ]] || die "the .config does not match $fragment (see above)"
}

# make's output goes to the log; the terminal gets a line every 100 files
# compiled and one when the final link starts. With pipefail the function
# fails when make does.
run_make() {
  local n=0 line
  make -C "$src" "${make_vars[@]}" -j"$(nproc)" vmlinux </dev/null 2>&1 |
    tee -a "$log" |
    while IFS= read -r line; do
      if [[ $line =~ ^\ +(CC|AS)\  ]]; then
        n=$((n + 1))
        if ((n % 100 == 0)); then step "make: $n files compiled"; fi
      elif [[ $line =~ ^\ +LD\ +vmlinux\.o$ ]]; then
        step "make: linking vmlinux ($n files compiled)"
      fi
    done
}

main() {
  install_deps
  [[ -r $TARBALL ]] || die "$TARBALL is missing although $SRC_PKG is installed"
  [[ -f $fragment ]] || die "missing $fragment"
  pkg_version=$(dpkg-query -W -f='${Version}' "$SRC_PKG")
  collect_patches

  local key
  key=$(build_key)
  if [[ -f $out/vmlinux && -f $out/key && $(<"$out/key") == "$key" ]]; then
    echo "kernel: up to date (${key:0:12})"
    return 0
  fi

  # Only one build per OUT_DIR at a time; a second caller waits, then finds
  # the kernel up to date.
  exec 9>"$out/.lock"
  if ! flock -n 9; then
    step "waiting for another build in $out"
    flock 9
    if [[ -f $out/vmlinux && -f $out/key && $(<"$out/key") == "$key" ]]; then
      echo "kernel: up to date (${key:0:12})"
      return 0
    fi
  fi

  step "building ${key:0:12} in $out"
  read_fragment
  # From here until the new key is written, OUT_DIR holds no valid kernel.
  rm -f "$out/key"
  : >"$log"
  prepare_tree

  # Fixed build identity: the same inputs give the same vmlinux bytes, so
  # templates keyed on the kernel's hash survive a rebuild.
  local stamp
  stamp=$(date -u -d "@$(stat -c %Y "$TARBALL")" '+%a %b %e %H:%M:%S UTC %Y')
  make_vars=(ARCH=x86_64 CROSS_COMPILE= LOCALVERSION= KBUILD_BUILD_USER=bud
    KBUILD_BUILD_HOST=bud KBUILD_BUILD_VERSION=1 "KBUILD_BUILD_TIMESTAMP=$stamp")

  step "configuring: allnoconfig + ${fragment#"$repo"/}"
  make -C "$src" "${make_vars[@]}" KCONFIG_ALLCONFIG="$fragment" allnoconfig \
    </dev/null >>"$log" 2>&1 || {
    tail -n 30 "$log" >&2
    die "make allnoconfig failed (log: $log)"
  }
  verify_config

  step "make -j$(nproc) vmlinux (log: $log)"
  if ! run_make || [[ ! -f $src/vmlinux ]]; then
    echo "kernel: last lines of $log:" >&2
    tail -n 40 "$log" >&2
    die "make vmlinux failed"
  fi

  cp "$src/vmlinux" "$out/vmlinux.tmp"
  mv -f "$out/vmlinux.tmp" "$out/vmlinux"
  echo "$key" >"$out/key.tmp"
  mv -f "$out/key.tmp" "$out/key"
  step "done: $out/vmlinux ($(stat -c %s "$out/vmlinux") bytes, key ${key:0:12})"
}

# On one line: bash reads a script as it runs, so an edit of this file during a build must
# not make it run what follows main.
main; exit
