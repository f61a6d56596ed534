#!/usr/bin/env bash
# Builds the Debian packages (`lenderd`, and `lendvm` with lendctl) with cargo-deb from the
# workspace's debug build, installs them with dpkg into a throwaway root (dpkg --root; the
# postinst honours $DPKG_ROOT and creates the lendvm user there), and runs the installed
# `lendctl --version`, `lenderd --help` and `man -l` on each man page. The packages are left
# in $CARGO_TARGET_DIR/debian/. About 20 s once the binaries are built (plus one
# `cargo install cargo-deb` of ~3 minutes on a fresh machine).
#
# The binaries are the debug ones so that CI does not build the workspace a second time in
# release; a release package is `cargo build --release` then the same commands with
# `--profile release`.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
target=${CARGO_TARGET_DIR:-$PWD/target}
profile=${LENDVM_DEB_PROFILE:-debug}
case "$profile" in
  debug) cargo_profile=dev ;;
  *) cargo_profile=$profile ;;
esac
fail() { echo "test-packages: $*" >&2; exit 1; }

command -v cargo-deb >/dev/null 2>&1 || cargo install cargo-deb --locked
command -v dpkg >/dev/null 2>&1 || fail "dpkg is missing"
command -v man >/dev/null 2>&1 || fail "man is missing (Debian's man-db; scripts/setup.sh)"

# --workspace, not -p: the same feature resolution as the build stage's, so nothing is built
# again (with -p cargo resolves features for those packages alone and rebuilds what they
# share).
cargo build --locked --profile "$cargo_profile" --workspace --bin lenderd --bin lendvm \
  --bin lendctl
bin="$target/$profile"
# Man pages and completions, generated from the clap definitions.
for b in lenderd lendvm lendctl; do
  rm -rf "$bin/assets/$b"
  "$bin/$b" --generate-assets "$bin/assets/$b"
done
out="$target/debian"
rm -rf "$out"
mkdir -p "$out"
for p in lending vmm; do
  cargo deb --locked --no-build --fast --profile "$cargo_profile" -p "$p" -o "$out" >/dev/null
done
ls -la "$out"

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates" "$root/etc"
: > "$root/var/lib/dpkg/status"
for f in passwd group shadow gshadow; do : > "$root/etc/$f"; done
# No shell or libc in the root: scripts run outside it (with DPKG_ROOT), dependencies are
# the host's.
dpkg --root="$root" --force-script-chrootless --force-depends --log=/dev/null \
  -i "$out"/lenderd_*.deb "$out"/lendvm_*.deb

for f in usr/bin/lenderd usr/bin/lendvm usr/bin/lendctl lib/systemd/system/lenderd.service \
  lib/systemd/system/lendvm@.service usr/share/bash-completion/completions/lendctl \
  usr/share/zsh/vendor-completions/_lenderd usr/share/fish/vendor_completions.d/lendvm.fish \
  usr/share/doc/lenderd/examples/lenderd.toml usr/share/doc/lendvm/examples/vm.toml; do
  [ -e "$root/$f" ] || fail "$f is not installed"
done
grep -q '^lendvm:' "$root/etc/passwd" || fail "the postinst did not create the lendvm user"
[ -d "$root/etc/lendvm" ] || fail "the postinst did not create /etc/lendvm"

v=$("$root/usr/bin/lendctl" --version)
echo "installed: $v"
[[ "$v" == lendctl\ * ]] || fail "lendctl --version: $v"
"$root/usr/bin/lenderd" --help | grep -q -- '--metrics' || fail "lenderd --help lacks --metrics"
for page in lenderd lendvm lendctl; do
  m=$(ls "$root"/usr/share/man/man1/"$page".1*)
  MANWIDTH=80 man -l "$m" 2>/dev/null | grep -q "$page" || fail "man -l $m shows nothing"
done
MANWIDTH=80 man -l "$root"/usr/share/man/man1/lenderd.1* | grep -q -- '--config' \
  || fail "the lenderd man page lacks --config"
echo "test-packages: ok in $((SECONDS - start))s"
