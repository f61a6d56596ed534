#!/usr/bin/env python3
"""fio inside the Linux guest, per VMM configuration (run by scripts/bench-guest.sh).

Every configuration boots the same kernel and initramfs and runs the same fio jobs
(tests/linux/initramfs/fio/*.fio) through the initramfs' runner (`lendvm_fio=...`,
`lendvm_fio_pause=`), one boot per configuration. Around each job the runner prints a marker
and pauses; at each marker this script snapshots the VM's KVM exit counters:

* lendvm: `lendctl --api-socket S counters --json` (GET /api/v1/vm.counters): the "vm"
  object's exits / mmio_exits / io_exits / halt_exits, summed over vCPUs from
  KVM_GET_STATS_FD;
* QEMU: QMP `query-stats` (target vcpu, provider kvm), the same KVM statistics, summed over
  vCPUs.

An idle window (the runner's idle-begin/idle-end) gives the exit rate of the idle guest
(timer ticks, ...). Per job it reports fio's IOPS, bandwidth and clat p50/p99 (fio's JSON), KVM
exits per I/O (all, and to user space: MMIO + port I/O) both raw and net of the idle rate,
and the ratio to the QEMU configuration of the same run.

Output: JSON and SVG (--out, --svg) and a Markdown table (--markdown, also printed).
Exit status 1, with the reason, when any configuration fails.
"""

import argparse
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

JOBS = [
    # (job file, direction of the figures, block size in bytes)
    ("randread-4k-qd1", "read", 4096),
    ("randread-4k-qd8", "read", 4096),
    ("randwrite-4k-qd1", "write", 4096),
    ("randwrite-4k-qd8", "write", 4096),
    ("seqread-128k-qd8", "read", 131072),
]

# name -> description, kind, lender device options, fabric, --remote-device mode
CONFIGS = {
    "lendvm-shm-irq-dbbuf-off": ("lendvm, NVMe lent over shm, interrupt mode, shadow doorbells off",
                                 "lendvm", "dbbuf=off", "shm", None),
    "lendvm-shm-irq-dbbuf-on": ("lendvm, NVMe lent over shm, interrupt mode, shadow doorbells + ioeventfd",
                                "lendvm", "dbbuf=on", "shm", None),
    "lendvm-shm-polling": ("lendvm, NVMe lent over shm, polling mode (writable doorbell page)",
                           "lendvm", "mode=polling", "shm", None),
    "lendvm-tcp-trapped": ("lendvm, NVMe lent over tcp (every BAR access trapped)",
                           "lendvm", "", "tcp", "trapped"),
    "qemu-nvme": ("QEMU (Debian), -device nvme,ioeventfd=on on a raw file (shadow doorbells + ioeventfd)",
                  "qemu", None, None, None),
    # Not in the default set: the lender's defaults, for branches without the dbbuf knob.
    "lendvm-shm-irq": ("lendvm, NVMe lent over shm, interrupt mode, the lender's defaults",
                       "lendvm", "", "shm", None),
}
DEFAULT_CONFIGS = ["lendvm-shm-irq-dbbuf-off", "lendvm-shm-irq-dbbuf-on", "lendvm-shm-polling",
                   "lendvm-tcp-trapped", "qemu-nvme"]
BASELINE = "qemu-nvme"

BASE_CMDLINE = "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 nokaslr lpj=1000000"
# QEMU passes the host's CPUID bits that the emulator cannot execute (lendvm masks them
# itself): see tests/linux/lib.sh and docs/linux-guest-on-pvm.md.
QEMU_CMDLINE = "noxsave clearcpuid=smap,smep,pcid,popcnt"
QEMU_CPU = "qemu64,-popcnt"
USERSPACE_CMDLINE = "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4"
DISK_SIZE = 64 << 20
TOKEN = "lendvm-bench-guest-token"
BDF = "0000:82:00.0"
COUNTER_KEYS = ("exits", "mmio_exits", "io_exits", "halt_exits")

MARK = re.compile(r"LENDVM-FIO (idle-begin|idle-end|run|ran|done)\b(.*)")


class ConfigFailed(Exception):
    pass


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] bench-guest: {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fields(text):
    return dict(w.split("=", 1) for w in text.split() if "=" in w)


# --------------------------------------------------------------------------------------
# Counter sources.

class LendvmCounters:
    def __init__(self, lendctl, api_socket, required):
        self.cmd = [lendctl, "--api-socket", api_socket, "--json", "counters"]
        self.required = required
        self.missing_reason = None

    def snapshot(self):
        if self.missing_reason is not None:
            return None
        try:
            out = subprocess.run(self.cmd, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            raise ConfigFailed("lendctl counters timed out")
        if out.returncode != 0:
            reason = f"`{' '.join(self.cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}"
            if self.required:
                raise ConfigFailed(reason + " (the VMM has no vm.counters endpoint? "
                                   "--allow-missing-counters reports exits as n/a)")
            log(f"warning: {reason}; exits reported as n/a")
            self.missing_reason = reason
            return None
        try:
            vm = json.loads(out.stdout)["vm"]
            return {k: int(vm[k]) for k in COUNTER_KEYS}
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigFailed(f"lendctl counters printed no vm.{{{','.join(COUNTER_KEYS)}}}: {e}: "
                               f"{out.stdout[:300]!r}")


class QmpCounters:
    def __init__(self, path, timeout=60):
        deadline = time.time() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.time() > deadline:
                    raise ConfigFailed(f"no QMP socket at {path}")
                time.sleep(0.1)
        self.sock.settimeout(30)
        self.buf = b""
        self._read()  # greeting
        self.cmd({"execute": "qmp_capabilities"})

    def _read(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConfigFailed("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def cmd(self, c):
        self.sock.sendall(json.dumps(c).encode() + b"\n")
        while True:
            r = self._read()
            if "event" in r:
                continue
            if "error" in r:
                raise ConfigFailed(f"QMP {c['execute']}: {r['error']}")
            return r["return"]

    def snapshot(self):
        r = self.cmd({"execute": "query-stats",
                      "arguments": {"target": "vcpu", "providers": [{"provider": "kvm"}]}})
        tot = {k: 0 for k in COUNTER_KEYS}
        seen = set()
        for vcpu in r:
            for st in vcpu.get("stats", []):
                if st["name"] in tot:
                    tot[st["name"]] += int(st["value"])
                    seen.add(st["name"])
        if seen != set(COUNTER_KEYS):
            raise ConfigFailed(f"QMP query-stats lacks {sorted(set(COUNTER_KEYS) - seen)}")
        return tot


# --------------------------------------------------------------------------------------
# One boot.

class Console:
    """Reads a child's stdout line by line; calls on_marker(kind, fields, t) in the reader
    thread, so counter snapshots happen while the guest pauses after the marker."""

    def __init__(self, stream, logf, on_marker):
        self.lines = []
        self.q = queue.Queue()
        self.on_marker = on_marker
        self.error = None
        self.t = threading.Thread(target=self._run, args=(stream, logf), daemon=True)
        self.t.start()

    def _run(self, stream, logf):
        t0 = time.time()
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            now = time.time()
            logf.write(f"{now - t0:8.2f} {line}\n")
            logf.flush()
            self.lines.append(line)
            m = MARK.search(line)
            if m:
                try:
                    self.on_marker(m.group(1), fields(m.group(2)), now)
                except Exception as e:  # reported by the main thread
                    self.error = e
                self.q.put(m.group(1))
        self.q.put(None)


def parse_fio_json(lines, index):
    begin = end = None
    for n, l in enumerate(lines):
        if f"LENDVM-FIO json-begin i={index}" in l and l.rstrip().endswith(f"i={index}"):
            begin = n
        if f"LENDVM-FIO json-end i={index}" in l and l.rstrip().endswith(f"i={index}") and begin is not None:
            end = n
            break
    if begin is None or end is None:
        raise ConfigFailed(f"run {index}: no JSON block on the console")
    text = "\n".join(l for l in lines[begin + 1:end] if not re.match(r"^\s*\[\s*\d+\.\d+\] ", l))
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigFailed(f"run {index}: fio's JSON does not parse: {e}")


def run_config(name, args, workdir):
    desc, kind, devopts, fabric, mode = CONFIGS[name]
    cdir = os.path.join(workdir, name)
    os.makedirs(cdir)
    disk = os.path.join(cdir, "disk.img")
    with open(disk, "wb") as f:
        f.truncate(DISK_SIZE)
    runs = ",".join(f"{j}@nvme0n1" for j, _, _ in JOBS)
    cmdline = f"{BASE_CMDLINE} {USERSPACE_CMDLINE} lendvm_fio={runs} lendvm_fio_pause={args.pause}"
    logpath = os.path.join(args.log_dir, f"{name}.log")
    logf = open(logpath, "w")
    procs = []
    snaps = {}
    counters = {"src": None}

    def on_marker(kind_, f, t):
        key = {"idle-begin": ("idle", "begin"), "idle-end": ("idle", "end"),
               "run": (f.get("i"), "begin"), "ran": (f.get("i"), "end")}.get(kind_)
        if key is None or counters["src"] is None:
            return
        snaps[key] = (t, counters["src"].snapshot())

    try:
        if kind == "lendvm":
            cluster = os.path.join(cdir, "cluster.toml")
            control = (f'"{cdir}/node1.sock"' if fabric == "shm"
                       else f'"127.0.0.1:{free_port()}"')
            with open(cluster, "w") as f:
                f.write(f'version = 1\ntoken = "{TOKEN}"\n[[node]]\nname = "node1"\n'
                        f'fabric = "{fabric}"\ncontrol = {control}\n')
            spec = f"{BDF}=nvme:path={disk},size={DISK_SIZE}" + (f",{devopts}" if devopts else "")
            lenderd = subprocess.Popen(
                [args.lenderd, "--node", "node1", "--cluster", cluster, "--device", spec],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.log_dir, f"{name}.lenderd.log"), "w"),
                env=dict(os.environ, RUST_LOG="info"))
            procs.append(lenderd)
            t_end = time.time() + 30
            while True:
                if lenderd.poll() is not None:
                    raise ConfigFailed(f"lenderd exited with {lenderd.returncode} "
                                       f"(device spec {spec!r}; see {args.log_dir}/{name}.lenderd.log)")
                if fabric == "shm" and os.path.exists(f"{cdir}/node1.sock"):
                    break
                if fabric == "tcp":
                    try:
                        socket.create_connection(("127.0.0.1", int(control.strip('"').split(":")[1])), 1).close()
                        break
                    except OSError:
                        pass
                if time.time() > t_end:
                    raise ConfigFailed("lenderd did not start listening within 30 s")
                time.sleep(0.1)
            api = os.path.join(cdir, "api.sock")
            dev = f"node1:{BDF},id=disk0" + (f",mode={mode}" if mode else "")
            argv = [args.lendvm, "--kernel", args.vmlinux, "--initramfs", args.initramfs,
                    "--memory", "128M", "--serial", "stdout", "--cmdline", cmdline,
                    "--cluster", cluster, "--name", f"bench-{name}",
                    "--remote-device", dev, "--api-socket", api]
            vm = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(
                os.path.join(args.log_dir, f"{name}.lendvm.log"), "w"),
                stdin=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="info"))
            procs.append(vm)
            counters["src"] = LendvmCounters(args.lendctl, api, not args.allow_missing_counters)
            ok_exit = 0
        else:
            qmp = os.path.join(cdir, "qmp.sock")
            argv = ["qemu-system-x86_64", "-enable-kvm", "-cpu", QEMU_CPU, "-machine", "q35",
                    "-m", "128M", "-smp", "1", "-display", "none", "-no-reboot",
                    "-monitor", "none", "-net", "none", "-serial", "stdio",
                    "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04",
                    "-kernel", args.bzimage, "-initrd", args.initramfs,
                    "-append", f"{cmdline} {QEMU_CMDLINE}",
                    "-drive", f"file={disk},if=none,id=nvm,format=raw",
                    # QEMU 7.2's NVMe has shadow doorbells (Doorbell Buffer Config) always;
                    # its doorbell ioeventfds are off unless asked for.
                    "-device", "nvme,serial=lendvmbench,drive=nvm,ioeventfd=on",
                    "-qmp", f"unix:{qmp},server=on,wait=off"]
            vm = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(
                os.path.join(args.log_dir, f"{name}.qemu.log"), "w"), stdin=subprocess.DEVNULL)
            procs.append(vm)
            counters["src"] = QmpCounters(qmp)
            ok_exit = 1  # isa-debug-exit: (0 << 1) | 1
        log(f"{name}: booting ({desc}); console in {logpath}")
        con = Console(vm.stdout, logf, on_marker)
        deadline = time.time() + args.timeout
        done = None
        while done is None:
            try:
                k = con.q.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                raise ConfigFailed(f"no `LENDVM-FIO done` within {args.timeout} s (see {logpath})")
            if con.error:
                raise ConfigFailed(f"counter snapshot failed: {con.error}")
            if k is None:
                raise ConfigFailed(f"the VM exited before `LENDVM-FIO done` (exit {vm.wait()}; see {logpath})")
            if k == "done":
                done = next(l for l in reversed(con.lines) if "LENDVM-FIO done" in l)
        try:
            rc = vm.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise ConfigFailed("the VM did not exit within 60 s of `LENDVM-FIO done`")
        if rc != ok_exit:
            raise ConfigFailed(f"the VM exited with {rc}, want {ok_exit} (see {logpath})")
        con.t.join(10)
        f = fields(done.split("LENDVM-FIO done", 1)[1])
        if f.get("failed") != "0" or f.get("runs") != str(len(JOBS)):
            raise ConfigFailed(f"guest runner: {done.strip()} (see {logpath})")
        missing = counters["src"].missing_reason if isinstance(counters["src"], LendvmCounters) else None
        return collect(name, desc, con.lines, snaps, missing, args)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        logf.close()


def collect(name, desc, lines, snaps, missing, args):
    idle_rate = None
    if ("idle", "begin") in snaps and ("idle", "end") in snaps:
        (t0, a), (t1, b) = snaps[("idle", "begin")], snaps[("idle", "end")]
        if a is not None and b is not None and t1 > t0:
            idle_rate = {k: (b[k] - a[k]) / (t1 - t0) for k in COUNTER_KEYS}
    jobs = []
    for i, (job, direction, bs) in enumerate(JOBS, start=1):
        data = parse_fio_json(lines, i)
        try:
            jj = data["jobs"][0]
            d = jj[direction]
            err = int(jj["error"])
        except (KeyError, IndexError, TypeError) as e:
            raise ConfigFailed(f"{job}: fio's JSON lacks {e}")
        if err != 0:
            raise ConfigFailed(f"{job}: fio reported error {err}")
        ios = int(d["total_ios"])
        pct = d.get("clat_ns", {}).get("percentile", {})
        r = {
            "job": job, "ios": ios, "iops": float(d["iops"]),
            "mib_per_s": float(d["bw_bytes"]) / (1 << 20),
            "clat_p50_us": pct.get("50.000000", 0) / 1000.0,
            "clat_p99_us": pct.get("99.000000", 0) / 1000.0,
            "fio_runtime_ms": int(jj.get("job_runtime", 0)),
        }
        key = str(i)
        if (key, "begin") in snaps and (key, "end") in snaps and snaps[(key, "begin")][1] is not None:
            (t0, a), (t1, b) = snaps[(key, "begin")], snaps[(key, "end")]
            delta = {k: b[k] - a[k] for k in COUNTER_KEYS}
            r["window_s"] = t1 - t0
            r["exits"] = delta
            r["exits_per_io"] = delta["exits"] / ios
            r["user_exits_per_io"] = (delta["mmio_exits"] + delta["io_exits"]) / ios
            r["mmio_exits_per_io"] = delta["mmio_exits"] / ios
            if idle_rate is not None:
                net = {k: max(0.0, delta[k] - idle_rate[k] * (t1 - t0)) for k in COUNTER_KEYS}
                r["net_exits_per_io"] = net["exits"] / ios
                r["net_user_exits_per_io"] = (net["mmio_exits"] + net["io_exits"]) / ios
        jobs.append(r)
    out = {"name": name, "description": desc, "idle_exit_rate_per_s": idle_rate, "jobs": jobs}
    if missing:
        out["counters_missing"] = missing
    return out


# --------------------------------------------------------------------------------------
# Report.

def ratios(results):
    base = next((c for c in results if c["name"] == BASELINE and "error" not in c), None)
    for c in results:
        if "error" in c or base is None:
            continue
        for j, bj in zip(c["jobs"], base["jobs"]):
            j["iops_vs_qemu"] = j["iops"] / bj["iops"] if bj["iops"] else None
            if "net_exits_per_io" in j and "net_exits_per_io" in bj and bj["net_exits_per_io"]:
                j["net_exits_vs_qemu"] = j["net_exits_per_io"] / bj["net_exits_per_io"]


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def markdown(results, meta):
    out = [f"Run {meta['date']} (`scripts/bench-guest.sh`, lendvm from `{meta['bin_dir']}`), {meta['host']}; kernel "
           f"`{meta['kernel']}`, initramfs `{meta['initramfs']}`; fio pause "
           f"{meta['pause_s']} s around each job.", ""]
    for c in results:
        if "error" in c:
            out.append(f"* **{c['name']}** ({c['description']}): **failed**: {c['error']}")
        elif c.get("counters_missing"):
            out.append(f"* {c['name']}: exits n/a, the VMM has no counters endpoint "
                       f"({c['counters_missing'].splitlines()[0]})")
    out.append("")
    out.append("| configuration | job | IOPS | MiB/s | clat p50 µs | clat p99 µs | exits/IO | "
               "user-space exits/IO | exits/IO net of idle | user-space net | IOPS ÷ QEMU |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in results:
        if "error" in c:
            continue
        for j in c["jobs"]:
            out.append(
                f"| {c['name']} | {j['job']} | {j['iops']:.0f} | {j['mib_per_s']:.2f} | "
                f"{j['clat_p50_us']:.0f} | {j['clat_p99_us']:.0f} | "
                f"{fmt(j.get('exits_per_io'), '.2f')} | {fmt(j.get('user_exits_per_io'), '.2f')} | "
                f"{fmt(j.get('net_exits_per_io'), '.2f')} | {fmt(j.get('net_user_exits_per_io'), '.2f')} | "
                f"{fmt(j.get('iops_vs_qemu'), '.2f')} |")
    idle = [f"{c['name']} {c['idle_exit_rate_per_s']['exits']:.0f}/s"
            for c in results if "error" not in c and c.get("idle_exit_rate_per_s")]
    if idle:
        out.append("")
        out.append("Idle guest exit rate (subtracted for the *net* columns): " + ", ".join(idle) + ".")
    return "\n".join(out) + "\n"


def svg(results):
    ok = [c for c in results if "error" not in c]
    jobs = [j for j, _, _ in JOBS]
    colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1"]
    panels = [("IOPS (fio, in the guest)", "iops"), ("KVM exits per I/O, net of idle", "net_exits_per_io"),
              ("user-space exits per I/O, net of idle", "net_user_exits_per_io")]
    pw, ph, left, top = 760, 220, 60, 40
    h = top + len(panels) * (ph + 60) + 20 + 16 * len(ok)
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{pw + left + 20}" height="{h}" '
         f'font-family="sans-serif" font-size="11">',
         f'<text x="{left}" y="20" font-size="14">fio in the Linux guest: lendvm configurations vs QEMU\'s NVMe</text>']
    for pi, (title, key) in enumerate(panels):
        y0 = top + pi * (ph + 60)
        vals = [j.get(key) for c in ok for j in c["jobs"] if j.get(key) is not None]
        vmax = max(vals) if vals else 1.0
        vmax = vmax * 1.1 if vmax > 0 else 1.0
        s.append(f'<text x="{left}" y="{y0 + 12}" font-size="12">{title}</text>')
        base = y0 + 20 + ph - 20
        s.append(f'<line x1="{left}" y1="{base}" x2="{left + pw}" y2="{base}" stroke="#333"/>')
        s.append(f'<text x="{left - 4}" y="{y0 + 24}" text-anchor="end">{vmax:.3g}</text>')
        s.append(f'<text x="{left - 4}" y="{base}" text-anchor="end">0</text>')
        gw = pw / len(jobs)
        bw = (gw - 10) / max(1, len(ok))
        for ji, job in enumerate(jobs):
            gx = left + ji * gw + 5
            s.append(f'<text x="{gx + (gw - 10) / 2}" y="{base + 14}" text-anchor="middle">{job}</text>')
            for ci, c in enumerate(ok):
                v = c["jobs"][ji].get(key)
                if v is None:
                    s.append(f'<text x="{gx + ci * bw + bw / 2}" y="{base - 3}" text-anchor="middle" '
                             f'font-size="8">n/a</text>')
                    continue
                bh = (ph - 30) * v / vmax
                s.append(f'<rect x="{gx + ci * bw:.1f}" y="{base - bh:.1f}" width="{bw - 1:.1f}" '
                         f'height="{bh:.1f}" fill="{colors[ci % len(colors)]}"><title>{c["name"]} '
                         f'{job}: {v:.3g}</title></rect>')
    ly = top + len(panels) * (ph + 60)
    for ci, c in enumerate(ok):
        s.append(f'<rect x="{left}" y="{ly + ci * 16}" width="10" height="10" fill="{colors[ci % len(colors)]}"/>')
        s.append(f'<text x="{left + 16}" y="{ly + ci * 16 + 9}">{c["name"]}: {c["description"]}</text>')
    s.append("</svg>")
    return "\n".join(s) + "\n"


def update_benchmarks_md(path, table, svg_rel):
    begin, end = "<!-- bench-guest:begin -->", "<!-- bench-guest:end -->"
    with open(path) as f:
        text = f.read()
    block = f"{begin}\n![fio in the guest]({svg_rel})\n\n{table}{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n## fio in the Linux guest (`scripts/bench-guest.sh`)\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vmlinux", required=True)
    ap.add_argument("--bzimage", required=True)
    ap.add_argument("--initramfs", required=True)
    ap.add_argument("--bin-dir", required=True, help="directory with lendvm, lenderd, lendctl")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated subset of {', '.join(CONFIGS)}")
    ap.add_argument("--pause", type=int, default=2, help="guest pause around each job, seconds")
    ap.add_argument("--timeout", type=int, default=1500, help="bound on one boot, seconds")
    ap.add_argument("--allow-missing-counters", action="store_true",
                    help="report exits as n/a when lendvm has no vm.counters endpoint")
    ap.add_argument("--out", required=True, help="JSON output")
    ap.add_argument("--svg", required=True)
    ap.add_argument("--markdown", help="docs/BENCHMARKS.md to update (between bench-guest markers)")
    ap.add_argument("--svg-rel", default="bench-guest.svg", help="the SVG's path relative to --markdown")
    ap.add_argument("--log-dir", required=True)
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {', '.join(bad)}; known: {', '.join(CONFIGS)}")
    for p in (args.vmlinux, args.bzimage, args.initramfs):
        if not os.path.isfile(p):
            ap.error(f"{p} is not a file")
    args.lendvm, args.lenderd, args.lendctl = (os.path.join(args.bin_dir, b) for b in ("lendvm", "lenderd", "lendctl"))
    if any(CONFIGS[n][1] == "lendvm" for n in names):
        for b in (args.lendvm, args.lenderd, args.lendctl):
            if not os.access(b, os.X_OK):
                ap.error(f"{b} not found (cargo build --release --bins)")
    if "qemu-nvme" in names and shutil.which("qemu-system-x86_64") is None:
        ap.error("qemu-system-x86_64 not found (apt-get install qemu-system-x86)")
    os.makedirs(args.log_dir, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="lendvm-bench-guest.") as work:
        for n in names:
            t0 = time.time()
            try:
                r = run_config(n, args, work)
                r["wall_s"] = round(time.time() - t0, 1)
                log(f"{n}: ok in {r['wall_s']} s: " + ", ".join(
                    f"{j['job']} {j['iops']:.0f} IOPS" for j in r["jobs"]))
            except ConfigFailed as e:
                log(f"{n}: FAILED: {e}")
                r = {"name": n, "description": CONFIGS[n][0], "error": str(e)}
            results.append(r)
    ratios(results)
    uname = os.uname()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": f"{os.cpu_count()} CPUs, {uname.sysname} {uname.release}",
            "kernel": os.path.basename(os.path.dirname(args.vmlinux)),
            "initramfs": os.path.basename(args.initramfs), "pause_s": args.pause,
            "bin_dir": args.bin_dir,
            "jobs": [{"job": j, "direction": d, "bs": b} for j, d, b in JOBS]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "guest-fio", "meta": meta, "configs": results}, f, indent=2)
    with open(args.svg, "w") as f:
        f.write(svg(results))
    table = markdown(results, meta)
    print(table)
    if args.markdown:
        update_benchmarks_md(args.markdown, table, args.svg_rel)
    log(f"wrote {args.out}, {args.svg}" + (f", {args.markdown}" if args.markdown else ""))
    failed = [c for c in results if "error" in c]
    if failed:
        for c in failed:
            print(f"bench-guest: configuration {c['name']} FAILED: {c['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
