#!/usr/bin/env bash
# The benchmark of the bar fabric's control paths in L1 (docs/BENCHMARKS.md, section l1):
#
#   scripts/bench-l1.sh [OUTDIR]      (default: target/bench; scripts/bench.sh l1 runs it)
#
# Boots L1 twice (scripts/test-vfio.sh --bench): once with the debug lenderd that the tests
# use, once with a release one. In each, tests/tests/vfio.rs bench_l1_control_paths
# measures both control paths, `control_path = "tcp"` (every message through QEMU's user
# network and L1's TCP stack) and `"ring"` (rings in the window, TCP only for wake-ups): the
# round trip of a status request from out here to L1's lenderd and back, and one
# verify-short fio job on QEMU's NVMe in L1 (its seconds, its I/Os, the lent NVMe's
# trapped accesses per I/O). "Before" is debug + tcp (what L1 ran until now), "after" is
# release + ring. Writes OUTDIR/l1-control-{debug,release}.json, OUTDIR/l1.md (the
# section's tables) and OUTDIR/l1-control.svg. ~6 min on the 2-core host with L1 under TCG
# (the default), ~25 min under KVM (LENDVM_VFIO_L1_ACCEL=kvm: this host's instruction emulator).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${CARGO_TARGET_DIR:-$PWD/target}/bench}
mkdir -p "$OUT"
rm -f "$OUT"/l1-control-*.json "$OUT/l1.md" "$OUT/l1-control.svg"
for p in debug release; do
	echo "[bench-l1] L1 with a $p lenderd" >&2
	LENDVM_L1_LENDERD_PROFILE=$p scripts/test-vfio.sh --bench "$OUT"
	[ -s "$OUT/l1-control-$p.json" ] || { echo "bench-l1: no $OUT/l1-control-$p.json" >&2; exit 1; }
done
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
accel = os.environ.get("LENDVM_VFIO_L1_ACCEL", "tcg")
runs = {p: json.load(open(f"{out}/l1-control-{p}.json")) for p in ("debug", "release")}
rows = []
for p in ("debug", "release"):
    for r in runs[p]["results"]:
        rows.append((p, r))
def cell(p, path):
    return next(r for q, r in rows if q == p and r["path"] == path)
before, after = cell("debug", "tcp"), cell("release", "ring")
md = []
md.append("| lenderd in L1 | control path | round trip p50 | p99 | mean | fio verify-short job | I/Os | trapped accesses | per I/O |")
md.append("|---|---|---|---|---|---|---|---|---|")
for p, r in rows:
    t = r["rtt_ms"]
    md.append(f"| {p} | {r['path']} | {t['p50']:.2f} ms | {t['p99']:.2f} ms | {t['mean']:.2f} ms | "
              f"{r['fio_job_s']:.1f} s | {r['fio_ios']} | {r['trapped_accesses']} | {r['trapped_per_io']:.1f} |")
md.append("")
md.append(f"Before (debug lenderd, control on tcp) → after (release lenderd, control through the "
          f"rings): round trip p50 {before['rtt_ms']['p50']:.2f} → {after['rtt_ms']['p50']:.2f} ms "
          f"({before['rtt_ms']['p50'] / max(after['rtt_ms']['p50'], 1e-9):.1f}× faster), the fio job "
          f"{before['fio_job_s']:.1f} → {after['fio_job_s']:.1f} s "
          f"({before['fio_job_s'] / max(after['fio_job_s'], 1e-9):.1f}×). "
          f"L1 under {accel} (scripts/test-vfio.sh's LENDVM_VFIO_L1_ACCEL); its slowness "
          f"(boot time against the reference, hundredths): "
          f"{runs['debug']['slowness']} and {runs['release']['slowness']}.")
open(f"{out}/l1.md", "w").write("\n".join(md) + "\n")
# Two groups of bars: the round trip (ms) and the fio job (s), one bar per configuration.
labels = [f"{p}/{r['path']}" for p, r in rows]
colors = ["#c0392b", "#e67e22", "#2980b9", "#27ae60"]
W, H, pad = 720, 300, 50
def group(x0, title, vals, unit):
    top = max(vals) or 1
    bw = 50
    s = [f'<text x="{x0 + 120}" y="20" font-size="14" text-anchor="middle">{title}</text>']
    for i, v in enumerate(vals):
        h = (H - 2 * pad) * v / top
        x = x0 + 10 + i * (bw + 10)
        s.append(f'<rect x="{x}" y="{H - pad - h:.1f}" width="{bw}" height="{h:.1f}" fill="{colors[i % 4]}"/>')
        s.append(f'<text x="{x + bw / 2}" y="{H - pad - h - 4:.1f}" font-size="11" text-anchor="middle">{v:.1f}{unit}</text>')
        s.append(f'<text x="{x + bw / 2}" y="{H - pad + 14}" font-size="10" text-anchor="middle">{labels[i]}</text>')
    return s
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
       f'<rect width="{W}" height="{H}" fill="white"/>']
svg += group(20, "status round trip to L1's lenderd (p50)", [r["rtt_ms"]["p50"] for _, r in rows], " ms")
svg += group(380, "fio verify-short job in the guest", [r["fio_job_s"] for _, r in rows], " s")
svg.append("</svg>")
open(f"{out}/l1-control.svg", "w").write("\n".join(svg) + "\n")
print(f"bench-l1: wrote {out}/l1.md and {out}/l1-control.svg")
EOF
