#!/usr/bin/env bash
# The host-side benchmarks on another machine (a quiet 16-core one, which has no Rust), from
# release binaries built here, on all its CPUs and confined to 2 with taskset, in one run:
#
#   scripts/bench-device.sh pack                here: build, strip and put the bench executables
#                                               and lendvm and lenderd in .bench-pack/
#   scripts/bench-device.sh run [SECTION ...]   there, in a copy of this tree with .bench-pack/:
#                                               every section in both modes; results in
#                                               $OUT/bench-device.tgz (else target/bench-device.tgz)
#   scripts/bench-device.sh import FILE.tgz     here: put each section's tables and goal lines in
#                                               docs/BENCHMARKS.md beside the 2-CPU ones, each
#                                               with its own stamp (the pack's commit, the
#                                               machine, the mode)
#
# Sections: fabric emulated lent hotplug p2p pin (default: all but pin). hotplug and pin need
# /dev/kvm there; a section whose bench fails is reported in the results and the others still
# run. Each run is bounded (`timeout`) so the whole stays inside one device call.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
# BENCH_PACK, BENCH_DOC: another pack and another document (the script's own tests).
PACK=${BENCH_PACK:-$REPO/.bench-pack}
DOC=${BENCH_DOC:-$REPO/docs/BENCHMARKS.md}
ALL=(fabric emulated lent hotplug p2p pin)
DEFAULT=(fabric p2p hotplug lent emulated)

die() { echo "bench-device: error: $*" >&2; exit 1; }
log() { echo "[bench-device $(date -u +%H:%M:%S)] $*" >&2; }

exe_of() { # section -> the cargo bench target
	case $1 in
	fabric) echo fabric ;; emulated) echo nvme ;; lent) echo nvme_lent ;; hotplug) echo hotplug ;;
	p2p) echo p2p ;; pin) echo pin ;; *) return 1 ;;
	esac
}
svg_of() { # section -> the SVG its bench writes
	case $1 in
	fabric) echo ntb.svg ;; lent) echo nvme-lent.svg ;; hotplug) echo hotplug.svg ;;
	p2p) echo p2p-bench.svg ;; pin) echo pin.svg ;; emulated) echo nvme-local.svg ;;
	esac
}

pack() {
	command -v cargo >/dev/null || die "cargo not found"
	command -v strip >/dev/null || die "strip not found (apt-get install binutils)"
	local targets=() s
	for s in "${ALL[@]}"; do targets+=(--bench "$(exe_of "$s")"); done
	log "building release binaries and benches"
	cargo build --profile release --workspace --bins --locked >&2
	rm -rf "$PACK" && mkdir -p "$PACK/bin"
	cargo bench --profile release --workspace "${targets[@]}" --locked --no-run \
		--message-format=json >"$PACK/cargo.json"
	for b in lendvm lenderd; do
		strip --strip-all -o "$PACK/bin/$b" "target/release/$b"
	done
	python3 - "$PACK/bin" "$PACK/cargo.json" <<'EOF' || die "no bench executables in cargo's output"
import json, subprocess, sys
out, found = sys.argv[1], 0
for line in open(sys.argv[2]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and "bench" in t.get("kind", []) and m.get("executable"):
        subprocess.run(["strip", "--strip-debug", "-o", f"{out}/bench-{t['name']}", m["executable"]], check=True)
        found += 1
sys.exit(0 if found else 1)
EOF
	rm -f "$PACK/cargo.json"
	local commit
	commit=$(git rev-parse --short=12 HEAD)
	if [ -n "$(git status --porcelain --untracked-files=no -- . ':!docs/BENCHMARKS.md' ':!docs/bench')" ]; then
		commit="$commit (with uncommitted changes)"
	fi
	printf '%s\n' "$commit" >"$PACK/commit"
	du -sh "$PACK" >&2
	log "packed $(ls "$PACK/bin" | wc -l) executables of commit $commit in .bench-pack/"
}

run() {
	[ -d "$PACK/bin" ] || die ".bench-pack/bin missing: run 'scripts/bench-device.sh pack' here first and carry .bench-pack"
	local sections=("$@") s
	[ ${#sections[@]} -gt 0 ] || sections=("${DEFAULT[@]}")
	for s in "${sections[@]}"; do exe_of "$s" >/dev/null || die "unknown section '$s' (known: ${ALL[*]})"; done
	local work
	work=$(mktemp -d)
	local cpus="$(nproc) CPUs ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1))"
	printf '%s\n' "$cpus; Linux $(uname -r)" >"$work/machine"
	cp "$PACK/commit" "$work/commit"
	local dest=${OUT:-$REPO/target}
	mkdir -p "$dest"
	local mode
	for mode in all 2cpu; do
		local dir=$work/$mode wrap=()
		mkdir -p "$dir/bench"
		[ "$mode" = all ] || wrap=(taskset -c 0,1)
		for s in "${sections[@]}"; do
			if { [ "$s" = hotplug ] || [ "$s" = pin ]; } && [ ! -w /dev/kvm ]; then
				echo "no /dev/kvm on this machine" >"$dir/bench/$s.failed"
				log "== $mode $s: skipped, no /dev/kvm"
				continue
			fi
			local la0 s0 rc=0
			la0=$(cut -d' ' -f1-3 /proc/loadavg) s0=$(date +%s)
			log "== $mode $s"
			env CARGO_TARGET_DIR="$dir" LENDVM_BIN_DIR="$PACK/bin" \
				P2P_BENCH_OUT="$dir/bench/p2p-bench.json" LENDVM_BENCH_QUICK=0 \
				timeout 240 "${wrap[@]}" "$PACK/bin/bench-$(exe_of "$s")" --bench \
				>"$dir/bench/$s.log" 2>&1 || rc=$?
			local secs=$(($(date +%s) - s0))
			printf '%s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')|$secs|$la0|$(cut -d' ' -f1-3 /proc/loadavg)|$rc" \
				>"$dir/bench/$s.stamp"
			[ "$rc" = 0 ] || echo "exit $rc" >"$dir/bench/$s.failed"
			log "== $mode $s: exit $rc in $secs s"
			# After every section, so a run cut short still brings back what it measured.
			tar czf "$dest/bench-device.tgz" -C "$work" .
		done
	done
	log "results in $dest/bench-device.tgz"
}

import() {
	local tgz=${1:-}
	[ -f "$tgz" ] || die "usage: scripts/bench-device.sh import FILE.tgz (the run's results)"
	local work
	work=$(mktemp -d)
	tar xzf "$tgz" -C "$work" || die "$tgz is not a gzip'd tar archive"
	[ -f "$DOC" ] || die "$DOC missing"
	local svgdir
	svgdir=$(dirname "$DOC")/bench
	mkdir -p "$svgdir"
	python3 - "$DOC" "$work" "$svgdir" <<'EOF' || die "import failed (see above)"
import os, shutil, sys
doc, work, svgdir = sys.argv[1:4]
for f in ("machine", "commit"):
    if not os.path.exists(f"{work}/{f}"):
        sys.exit(f"bench-device: error: the results have no '{f}' file: not an archive of 'scripts/bench-device.sh run'")
text = open(doc).read()
machine = open(f"{work}/machine").read().strip()
commit = open(f"{work}/commit").read().strip()
names = {"all": "all CPUs", "2cpu": "confined to CPUs 0 and 1 with `taskset -c 0,1`"}
svgs = {"fabric": "ntb.svg", "lent": "nvme-lent.svg", "hotplug": "hotplug.svg",
        "p2p": "p2p-bench.svg", "pin": "pin.svg", "emulated": "nvme-local.svg"}
exes = {"fabric": "fabric", "emulated": "nvme", "lent": "nvme_lent", "hotplug": "hotplug",
        "p2p": "p2p", "pin": "pin"}
done = []
# Each new block goes right after the section's own: "2cpu" first, so "all" ends up above it.
for mode in ("2cpu", "all"):
    d = f"{work}/{mode}/bench"
    if not os.path.isdir(d):
        continue
    for sec in exes:
        stamp_f = f"{d}/{sec}.stamp"
        skipped = os.path.exists(f"{d}/{sec}.failed")
        if not os.path.exists(stamp_f) and not skipped:
            continue
        key = f"{sec}@16cpu-{mode}"
        b, e = f"<!-- bench:{key}:begin -->", f"<!-- bench:{key}:end -->"
        if skipped and not os.path.exists(stamp_f):
            why = open(f"{d}/{sec}.failed").read().strip()
            body = f"*On the other machine ({machine}), {names[mode]}: not run ({why}).*\n"
        else:
            when, secs, la0, la1, rc = open(stamp_f).read().strip().split("|")
            head = (f"*Measured on another machine by the bench `{exes[sec]}`, from the release binaries of "
                    f"commit `{commit}` (`scripts/bench-device.sh`), {when}, in {secs} s; "
                    f"{machine}; {names[mode]}; load average {la0} before, {la1} after.*")
            frag = f"{d}/{sec}.md"
            if skipped or not os.path.exists(frag):
                why = open(f"{d}/{sec}.failed").read().strip() if skipped else "no fragment"
                log = open(f"{d}/{sec}.log").read().strip().splitlines()[-3:] if os.path.exists(f"{d}/{sec}.log") else []
                body = head + f" **The bench failed ({why}).** Its last lines:\n\n```\n" + "\n".join(log) + "\n```\n"
            else:
                body = head + "\n\n"
                svg = f"{d}/{svgs[sec]}"
                if os.path.exists(svg):
                    name = f"{sec}-16cpu-{mode}.svg"
                    shutil.copy(svg, f"{svgdir}/{name}")
                    body += f"![{sec}, other machine, {mode}](bench/{name})\n\n"
                body += open(frag).read().rstrip() + "\n"
        if text.count(b) != 1:
            # New markers go right after the section's own (2-CPU) block.
            anchor = f"<!-- bench:{sec}:end -->"
            if text.count(anchor) != 1:
                sys.exit(f"bench-device: error: {doc} has no single '{anchor}' (the section's own block)")
            i = text.index(anchor) + len(anchor)
            text = text[:i] + f"\n\n**{sec}, on the other machine ({machine}), {names[mode]}:**\n\n{b}\n{e}" + text[i:]
        i, j = text.index(b) + len(b), text.index(e)
        text = text[:i] + "\n" + body + text[j:]
        done.append(key)
open(doc, "w").write(text)
print("bench-device: imported " + (", ".join(done) if done else "nothing"), file=sys.stderr)
EOF
}

case ${1:-} in
pack) shift; pack "$@" ;;
run) shift; run "$@" ;;
import) shift; import "$@" ;;
-h | --help | "") sed -n '2,19p' "$0"; [ -n "${1:-}" ] || exit 2 ;;
*) die "unknown command '$1' (pack, run, import)" ;;
esac
