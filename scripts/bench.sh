#!/usr/bin/env bash
# Every benchmark of docs/BENCHMARKS.md from one command:
#
#   scripts/bench.sh [--quick] [--guest] [--no-docs] [--release] [SECTION ...]
#
# Sections (default: all but guest and l1; `--guest` adds guest, l1 runs when named):
#   fabric     cargo bench -p ntb --bench fabric              shm/tcp windows vs memcpy and a plain TLS stream; doorbells
#   emulated   cargo bench -p emulated --bench nvme           the emulated NVMe controller in-process
#   lent       cargo bench -p lending --bench nvme_lent       the same controller local vs lent by lenderd
#   hotplug    cargo bench -p vmm --bench hotplug             hot-add latency through the API
#   p2p        cargo bench -p lending --bench p2p             peer-to-peer vs through RAM
#   pin        cargo bench -p vmm --bench pin                 pinning guest RAM vs memset
#   directory  cargo bench -p api --bench directory           etcd directory vs static fan-out; claims; device loss (needs etcd)
#   migration  cargo bench -p lendvm-tests --bench migration  live migration with a lent NVMe
#   guest      scripts/bench-guest.sh                         fio in the Linux guest (QEMU, guest kernel; ~20 min)
#   l1         scripts/bench-l1.sh                            the bar fabric's control paths in L1 (two L1 boots; ~6 min)
#
# Each bench writes target/bench/<section>.md (its tables and goal lines, generated from the
# measured data), besides its JSON and SVG. This script puts the fragment between
# `<!-- bench:<section>:begin -->` and `<!-- bench:<section>:end -->` in docs/BENCHMARKS.md with
# a stamp (commit, date, CPUs, kernel, load average before and after, the command), and copies
# the SVG to docs/bench/<section>.svg. A section whose bench fails or writes no fragment is
# reported and the others still run (so `scripts/bench.sh directory migration` re-runs just
# those); the exit status is 1 if any failed.
#
# --quick    a short budget of each (LENDVM_BENCH_QUICK=1; dev profile unless --release), to
#            check that they all run: what CI does. Writes only target/bench/, never the docs.
# --no-docs  full budgets, but leave docs/ alone.
# --release  build the release profile also with --quick (the full run always does).
# --guest    add the guest section (scripts/bench-guest.sh; not part of --quick by default).
#
# Long runs are niced. Full run: ~25 min without the guest section on the 2-core host.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ALL=(fabric emulated lent hotplug p2p pin directory migration)

die() { echo "bench: error: $*" >&2; exit 1; }
log() { echo "[bench $(date -u +%H:%M:%S)] $*" >&2; }

quick=0 docs=1 release=0 guest=0 sections=()
cmdline="scripts/bench.sh${*:+ $*}"
while [ $# -gt 0 ]; do
	case $1 in
	--quick) quick=1; docs=0; shift ;;
	--no-docs) docs=0; shift ;;
	--release) release=1; shift ;;
	--guest) guest=1; shift ;;
	-h | --help) sed -n '2,34p' "$0"; exit 0 ;;
	-*) die "unknown option $1 (see --help)" ;;
	*)
		case " ${ALL[*]} guest l1 " in
		*" $1 "*) sections+=("$1") ;;
		*) die "unknown section '$1' (known: ${ALL[*]} guest l1)" ;;
		esac
		shift
		;;
	esac
done
[ ${#sections[@]} -gt 0 ] || sections=("${ALL[@]}")
if [ "$guest" = 1 ] && [[ " ${sections[*]} " != *" guest "* ]]; then sections+=(guest); fi

command -v cargo >/dev/null || die "cargo not found (install Rust: see README)"
command -v python3 >/dev/null || die "python3 not found (apt-get install python3)"
command -v git >/dev/null || die "git not found"

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
OUT=$CARGO_TARGET_DIR/bench
mkdir -p "$OUT"
if [ "$quick" = 1 ]; then
	export LENDVM_BENCH_QUICK=1
else
	unset LENDVM_BENCH_QUICK
	release=1
fi
if [ "$release" = 1 ]; then profile=release pdir=release; else profile=dev pdir=debug; fi

# The commit the figures belong to. Changes to the documents this script writes do not make
# a tree dirty; anything else does, and the stamp says so.
commit=$(git rev-parse --short=12 HEAD)
if [ -n "$(git status --porcelain --untracked-files=no -- . ':!docs/BENCHMARKS.md' ':!docs/bench')" ]; then
	commit="$commit (with uncommitted changes)"
	[ "$docs" = 0 ] || log "warning: the tree has uncommitted changes; the stamps will say so"
fi
cpus="$(nproc) CPUs ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1))"
kernel="Linux $(uname -r)"
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

# Prerequisites, checked before anything is built so a missing one fails in seconds.
needs() { [[ " ${sections[*]} " == *" $1 "* ]]; }
if needs hotplug || needs migration; then
	[ -c /dev/kvm ] && [ -r /dev/kvm ] && [ -w /dev/kvm ] ||
		die "hotplug/migration need /dev/kvm (read-write) for lendvm's guests; not available here"
fi
if needs directory; then
	command -v etcd >/dev/null ||
		die "directory needs etcd on PATH (scripts/setup.sh installs it: apt-get install etcd-server)"
fi
if needs l1; then
	command -v qemu-system-x86_64 >/dev/null ||
		die "l1 needs QEMU (apt-get install qemu-system-x86; scripts/setup.sh installs it)"
fi
if needs guest; then
	command -v qemu-system-x86_64 >/dev/null || [ "$(id -u)" = 0 ] ||
		die "guest needs QEMU (apt-get install qemu-system-x86; scripts/bench-guest.sh installs it as root)"
fi

# Builds once (all benches are run with --workspace, so one feature set and no rebuild per
# section): every binary the benches start (lendvm, lenderd, lendctl) and the bench
# executables, in the profile they run in (they find the binaries beside themselves).
log "building binaries and benches ($profile profile)"
t0=$(date +%s)
nice -n 10 cargo build --profile "$profile" --workspace --bins --locked >&2 ||
	die "cargo build --profile $profile --workspace --bins failed"
for b in lendvm lenderd lendctl; do
	[ -x "$CARGO_TARGET_DIR/$pdir/$b" ] ||
		die "$CARGO_TARGET_DIR/$pdir/$b missing after the build (no $profile build of $b)"
done
# The bench files only (--bench NAME each), not --benches: that also builds every library and
# binary of the workspace as a bench harness (they have no benchmarks), a second test-mode
# build of the whole workspace that a loaded CI run paid about two minutes for.
bench_targets=()
for b in fabric nvme nvme_lent hotplug p2p pin directory migration; do
	bench_targets+=(--bench "$b")
done
nice -n 10 cargo bench --profile "$profile" --workspace "${bench_targets[@]}" --locked --no-run >&2 ||
	die "cargo bench --no-run failed"
log "built in $(($(date +%s) - t0)) s"

bench_cmd() { # section -> the command that runs it
	case $1 in
	fabric) echo "cargo bench --profile $profile --locked --workspace --bench fabric" ;;
	emulated) echo "cargo bench --profile $profile --locked --workspace --bench nvme" ;;
	lent) echo "cargo bench --profile $profile --locked --workspace --bench nvme_lent" ;;
	hotplug) echo "cargo bench --profile $profile --locked --workspace --bench hotplug" ;;
	p2p) echo "cargo bench --profile $profile --locked --workspace --bench p2p" ;;
	pin) echo "cargo bench --profile $profile --locked --workspace --bench pin" ;;
	directory) echo "cargo bench --profile $profile --locked --workspace --bench directory" ;;
	migration) echo "cargo bench --profile $profile --locked --workspace --bench migration" ;;
	guest) if [ "$quick" = 1 ]; then
		echo "scripts/bench-guest.sh --no-docs --configs lendvm-shm-irq-dbbuf-on,qemu-nvme"
	elif [ "$docs" = 1 ]; then echo "scripts/bench-guest.sh"; else echo "scripts/bench-guest.sh --no-docs"; fi ;;
	l1) echo "scripts/bench-l1.sh $OUT" ;;
	esac
}
svg_of() { # section -> the SVG its bench writes (relative to $OUT)
	case $1 in
	fabric) echo ntb.svg ;; lent) echo nvme-lent.svg ;; hotplug) echo hotplug.svg ;;
	p2p) echo p2p-bench.svg ;; pin) echo pin.svg ;; directory) echo directory.svg ;;
	migration) echo migration-bench.svg ;; guest) echo guest-fio.svg ;; emulated) echo nvme-local.svg ;;
	l1) echo l1-control.svg ;;
	esac
}

# Puts target/bench/<section>.md (+ stamp, + the SVG) between the section's markers.
put_section() { # section stamp-file
	python3 - "$REPO/docs/BENCHMARKS.md" "$1" "$2" "$OUT/$1.md" <<'EOF'
import sys
doc, sec, stamp, frag = sys.argv[1:5]
text = open(doc).read()
b, e = f"<!-- bench:{sec}:begin -->", f"<!-- bench:{sec}:end -->"
if text.count(b) != 1 or text.count(e) != 1 or text.index(b) > text.index(e):
    sys.exit(f"bench: docs/BENCHMARKS.md has no single '{b}' … '{e}' pair for section {sec}")
body = open(stamp).read().rstrip() + "\n\n"
if sec != "guest":
    body += open(frag).read().rstrip() + "\n"
i, j = text.index(b) + len(b), text.index(e)
open(doc, "w").write(text[:i] + "\n" + body + text[j:])
EOF
}

failed=() done_=() start=$(date +%s)
for s in "${sections[@]}"; do
	cmd=$(bench_cmd "$s")
	frag=$OUT/$s.md
	[ "$s" != guest ] || frag=$OUT/guest-fio.json
	rm -f "$frag" "$OUT/$s.stamp"
	log "== $s: $cmd"
	la0=$(loadavg) ts=$(date -u '+%Y-%m-%d %H:%M UTC') s0=$(date +%s)
	env=(LENDVM_BENCH_QUICK="${LENDVM_BENCH_QUICK:-0}")
	case $s in
	p2p) env+=(P2P_BENCH_OUT="$OUT/p2p-bench.json") ;;
	migration) env+=(MIG_BENCH_JSON="$OUT/migration-bench.json") ;;
	esac
	rc=0
	env "${env[@]}" nice -n 10 $cmd >&2 || rc=$?
	secs=$(($(date +%s) - s0)) la1=$(loadavg)
	if [ "$rc" != 0 ]; then
		log "!! $s: the bench failed (exit $rc) after $secs s; see its output above"
		failed+=("$s")
		continue
	fi
	if [ ! -s "$frag" ]; then
		log "!! $s: the bench exited 0 but wrote no $frag (every bench must write its fragment)"
		failed+=("$s")
		continue
	fi
	q=""
	[ "$quick" = 0 ] || q=" **Quick budget (LENDVM_BENCH_QUICK=1, $profile profile): checks that it runs, the figures mean nothing.**"
	printf '%s\n' "*Measured by \`${cmd/ --locked/}\` (via \`$cmdline\`) on commit \`$commit\`, $ts, in $secs s; $cpus, $kernel; load average $la0 before, $la1 after.*$q" >"$OUT/$s.stamp"
	svg=$(svg_of "$s")
	if [ "$docs" = 1 ]; then
		mkdir -p docs/bench
		# (scripts/bench-guest.sh puts its own SVG and table into the docs.)
		if [ "$s" != guest ] && [ -f "$OUT/$svg" ]; then
			cp "$OUT/$svg" "docs/bench/$s.svg"
			printf '\n![%s](bench/%s.svg)\n' "$s" "$s" >>"$OUT/$s.stamp"
		fi
		put_section "$s" "$OUT/$s.stamp" || { failed+=("$s"); continue; }
	fi
	done_+=("$s")
	log "== $s: done in $secs s"
done
total=$(($(date +%s) - start))
echo "bench: ${#done_[@]} section(s) done (${done_[*]:-none}) in $total s total$([ "$docs" = 1 ] && echo ', docs/BENCHMARKS.md updated')" >&2
if [ ${#failed[@]} -gt 0 ]; then
	echo "bench: FAILED: ${failed[*]} (re-run just those: scripts/bench.sh$([ "$quick" = 1 ] && echo ' --quick') ${failed[*]})" >&2
	exit 1
fi
