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
# QEMU with a host-like CPU (`--qemu-cpu host...`/`max...`): the guest sees what lendvm's
# `--cpu-model host` shows it, so it gets what lendvm appends on this host (its log line
# "command line is now ..."), as far as Linux's 127-byte clearcpuid= buffer goes.
QEMU_CMDLINE_HOST = ("noxsave clearcpuid=smap,smep,pcid,popcnt,rdrand,rdseed,fsgsbase,movdiri,"
                     "movdir64b,cldemote,serialize,bmi1,bmi2,adx,sha_ni,aes,pclmulqdq,sse4_2")
USERSPACE_CMDLINE = "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4"
DISK_SIZE = 64 << 20
TOKEN = "lendvm-bench-guest-token-of-32-bytes-or-more"  # lenderd wants >= 32 bytes
BDF = "0000:82:00.0"
COUNTER_KEYS = ("exits", "mmio_exits", "io_exits", "halt_exits")
# The vCPU threads' names (/proc/.../comm): lendvm's vcpu.rs, QEMU's "CPU n/KVM".
def vcpu_threads(kind, cpus):
    return ({f"vcpu{i}" for i in range(cpus)} if kind == "lendvm"
            else {f"CPU {i}/KVM" for i in range(cpus)})

CPUINFO = re.compile(r"LENDVM-CPUINFO ([a-z ]+?)\s*:\s*(.*)")
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
            snap = {k: int(vm[k]) for k in COUNTER_KEYS}
            # Every other KVM statistic too (page faults, emulated instructions, interrupt
            # windows, ...): the per-reason profile of a job.
            snap.update({k: v for k, v in vm.items() if isinstance(v, int) and k not in snap})
            return snap
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
                if isinstance(st.get("value"), int):
                    tot[st["name"]] = tot.get(st["name"], 0) + st["value"]
                    seen.add(st["name"])
        if not set(COUNTER_KEYS) <= seen:
            raise ConfigFailed(f"QMP query-stats lacks {sorted(set(COUNTER_KEYS) - seen)}")
        return tot


class CpuProbe:
    """Where the CPU went: per-thread run time and run-queue wait (/proc/PID/task/TID/schedstat)
    of the VM process and the lender, and the host's busy time (/proc/stat).

    The guest kernel runs in KVM's instruction emulator on this host, so a job's IOPS follow
    how much CPU its vCPU thread gets. Run-queue wait is time the vCPU thread was runnable
    but another thread had the core: the direct measure of contention."""

    def __init__(self, pids):
        self.pids = pids  # role -> pid
        self.hz = os.sysconf("SC_CLK_TCK")

    def _host_busy_ns(self):
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return (sum(v[:8]) - idle) * 1_000_000_000 // self.hz

    def snapshot(self):
        threads = {}
        for role, pid in self.pids.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        comm = f.read().strip()
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        run_ns, wait_ns, _ = (int(x) for x in f.read().split())
                except (OSError, ValueError):
                    continue  # the thread ended
                threads[(role, int(tid))] = (comm, run_ns, wait_ns)
        return {"host_busy_ns": self._host_busy_ns(), "threads": threads}

    @staticmethod
    def delta(a, b, window_s, vcpu_names):
        """Cores used per role over the window, the vCPU thread's run and wait shares, and the
        rest of the host's busy time (other processes)."""
        win = window_s * 1e9
        out = {"vcpu_cpu": 0.0, "vcpu_wait": 0.0, "vmm_other_cpu": 0.0, "lender_cpu": 0.0}
        busiest = ("", 0.0)
        for key, (comm, run, wait) in b["threads"].items():
            run0, wait0 = (a["threads"][key][1:] if key in a["threads"] else (0, 0))
            dr, dw = (run - run0) / win, (wait - wait0) / win
            role = key[0]
            if role == "vm" and comm in vcpu_names:
                out["vcpu_cpu"] += dr
                out["vcpu_wait"] += dw
            elif role == "vm":
                out["vmm_other_cpu"] += dr
            else:
                out["lender_cpu"] += dr
                if dr > busiest[1]:
                    busiest = (comm, dr)
        out["lender_busiest_thread"] = busiest[0]
        own = out["vcpu_cpu"] + out["vmm_other_cpu"] + out["lender_cpu"]
        out["host_other_cpu"] = max(0.0, (b["host_busy_ns"] - a["host_busy_ns"]) / win - own)
        return out


class PerfProbe:
    """`perf record` of the vCPU thread over one job (--perf): where the host spends the
    vCPU thread's time, KVM's instruction emulator and shadow MMU included (kernel symbols
    are readable here; tracefs is not, so sampling is the way in)."""

    def __init__(self, vm_pid, vcpu_names, out_dir, guest_map=None):
        self.vm_pid, self.vcpu_names, self.out_dir = vm_pid, vcpu_names, out_dir
        self.proc = None
        self.path = None
        # With the guest kernel's System.map: sample KVM's emulated instructions instead
        # (tracepoint kvm:kvm_emulate_insn, every GUEST_PERIOD-th), and name the guest
        # kernel functions they were in. Needs tracefs mounted (done here if it is not).
        self.guest_syms = None
        if guest_map is not None:
            syms = []
            with open(guest_map) as f:
                for l in f:
                    a, t, name = l.split()[:3]
                    if t in "tTwW":
                        syms.append((int(a, 16), name))
            syms.sort()
            self.guest_syms = ([a for a, _ in syms], [n for _, n in syms])
            if not os.path.exists("/sys/kernel/tracing/events/kvm"):
                subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], check=False)

    def _vcpu_tid(self):
        for tid in os.listdir(f"/proc/{self.vm_pid}/task"):
            try:
                with open(f"/proc/{self.vm_pid}/task/{tid}/comm") as f:
                    if f.read().strip() in self.vcpu_names:
                        return tid
            except OSError:
                continue
        raise ConfigFailed("perf: no vCPU thread found")

    def start(self, index):
        self.path = os.path.join(self.out_dir, f"job{index}.perf.data")
        event = (["-e", "kvm:kvm_emulate_insn", "-c", str(GUEST_PERIOD)] if self.guest_syms
                 else ["-F", "999"])
        self.proc = subprocess.Popen(["perf", "record", "-q", *event, "-t", self._vcpu_tid(),
                                      "-o", self.path], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def stop(self, top=12):
        """Stops the recording; the top symbols by share of samples."""
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise ConfigFailed("perf record did not stop")
        self.proc = None
        if self.guest_syms is not None:
            return self._guest_top(top)
        out = subprocess.run(["perf", "report", "-i", self.path, "--stdio", "--sort", "sym",
                              "--percent-limit", "0.5"], capture_output=True, text=True, timeout=300)
        rows = []
        for l in out.stdout.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+\[(.)\]\s+(\S+)", l)
            if m:
                rows.append((m.group(3), float(m.group(1))))
        samples = re.search(r"# Samples: (\S+)", out.stdout)
        return {"samples": samples.group(1) if samples else "0", "top": rows[:top]}

    def _guest_top(self, top):
        import bisect
        out = subprocess.run(["perf", "script", "-i", self.path, "-F", "trace"],
                             capture_output=True, text=True, timeout=600)
        addrs, names = self.guest_syms
        counts, n = {}, 0
        for l in out.stdout.splitlines():
            m = re.match(r"\s*[0-9a-f]+:([0-9a-f]+):", l)
            if not m:
                continue
            rip = int(m.group(1), 16)
            i = bisect.bisect_right(addrs, rip) - 1
            name = names[i] if i >= 0 and rip >= 0xffffffff80000000 else "(user/other)"
            counts[name] = counts.get(name, 0) + 1
            n += 1
        rows = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return {"emulated_insns": n * GUEST_PERIOD, "period": GUEST_PERIOD,
                "top": [(k, 100.0 * v / n) for k, v in rows] if n else []}


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


def run_config(name, args, workdir, rep=1):
    desc, kind, devopts, fabric, mode = CONFIGS[name]
    cdir = os.path.join(workdir, name)
    os.makedirs(cdir)
    tag = name if args.repeat <= 1 else f"{name}.rep{rep}"
    disk = os.path.join(cdir, "disk.img")
    with open(disk, "wb") as f:
        f.truncate(DISK_SIZE)
    runs = ",".join(f"{j}@nvme0n1" for j, _, _ in JOBS)
    cmdline = f"{BASE_CMDLINE} {USERSPACE_CMDLINE} lendvm_fio={runs} lendvm_fio_pause={args.pause} lendvm_fio_profile=1"
    logpath = os.path.join(args.log_dir, f"{tag}.log")
    logf = open(logpath, "w")
    procs = []
    snaps = {}
    counters = {"src": None, "cpu": None}
    perf = {}

    def on_marker(kind_, f, t):
        key = {"idle-begin": ("idle", "begin"), "idle-end": ("idle", "end"),
               "run": (f.get("i"), "begin"), "ran": (f.get("i"), "end")}.get(kind_)
        if key is None or counters["src"] is None:
            return
        if counters.get("perf") is not None and key[0] != "idle" and key[1] == "end":
            perf[key[0]] = counters["perf"].stop()
        snaps[key] = (t, counters["src"].snapshot(), counters["cpu"].snapshot())
        if counters.get("perf") is not None and key[0] != "idle" and key[1] == "begin":
            counters["perf"].start(key[0])

    try:
        if kind == "lendvm":
            cluster = os.path.join(cdir, "cluster.toml")
            control = (f'"{cdir}/node1.sock"' if fabric == "shm"
                       else f'"127.0.0.1:{free_port()}"')
            with open(cluster, "w") as f:
                f.write(f'version = 1\ntoken = "{TOKEN}"\n[[node]]\nname = "node1"\n'
                        f'fabric = "{fabric}"\ncontrol = {control}\n')
            os.chmod(cluster, 0o600)  # it holds the token inline: lenderd refuses it otherwise
            spec = f"{BDF}=nvme:path={disk},size={DISK_SIZE}" + (f",{devopts}" if devopts else "")
            lenderd = subprocess.Popen(
                [args.lenderd, "--node", "node1", "--cluster", cluster, "--device", spec],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.log_dir, f"{tag}.lenderd.log"), "w"),
                env=dict(os.environ, RUST_LOG="info"))
            procs.append(lenderd)
            t_end = time.time() + 30
            while True:
                if lenderd.poll() is not None:
                    raise ConfigFailed(f"lenderd exited with {lenderd.returncode} "
                                       f"(device spec {spec!r}; see {args.log_dir}/{tag}.lenderd.log)")
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
                    "--memory", "128M", "--cpus", str(args.cpus), "--cpu-model", args.cpu_model,
                    "--serial", "stdout", "--cmdline", cmdline,
                    "--cluster", cluster, "--name", f"bench-{name}",
                    "--remote-device", dev, "--api-socket", api]
            vm = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(
                os.path.join(args.log_dir, f"{tag}.lendvm.log"), "w"),
                stdin=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="info"))
            procs.append(vm)
            counters["cpu"] = CpuProbe({"vm": vm.pid, "lender": lenderd.pid})
            if args.perf or args.perf_guest:
                counters["perf"] = PerfProbe(vm.pid, vcpu_threads(kind, args.cpus), cdir, guest_map(args))
            counters["src"] = LendvmCounters(args.lendctl, api, not args.allow_missing_counters)
            ok_exit = 0
        else:
            qmp = os.path.join(cdir, "qmp.sock")
            argv = ["qemu-system-x86_64", "-enable-kvm", "-cpu", args.qemu_cpu, "-machine", "q35",
                    "-m", "128M", "-smp", str(args.cpus), "-display", "none", "-no-reboot",
                    # Names the vCPU thread "CPU 0/KVM" for the CPU profile.
                    "-name", "bench,debug-threads=on",
                    "-monitor", "none", "-net", "none", "-serial", "stdio",
                    "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04",
                    "-kernel", args.bzimage, "-initrd", args.initramfs,
                    "-append", f"{cmdline} {args.qemu_append}",
                    "-drive", f"file={disk},if=none,id=nvm,format=raw",
                    # QEMU 7.2's NVMe has shadow doorbells (Doorbell Buffer Config) always;
                    # its doorbell ioeventfds are off unless asked for.
                    "-device", "nvme,serial=lendvmbench,drive=nvm,ioeventfd=on",
                    "-qmp", f"unix:{qmp},server=on,wait=off"]
            vm = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(
                os.path.join(args.log_dir, f"{tag}.qemu.log"), "w"), stdin=subprocess.DEVNULL)
            procs.append(vm)
            counters["cpu"] = CpuProbe({"vm": vm.pid})
            if args.perf or args.perf_guest:
                counters["perf"] = PerfProbe(vm.pid, vcpu_threads(kind, args.cpus), cdir, guest_map(args))
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
        r = collect(name, desc, con.lines, snaps, missing, args, vcpu_threads(kind, args.cpus))
        for i, j in enumerate(r["jobs"], start=1):
            if str(i) in perf:
                j["perf"] = perf[str(i)]
        # The CPU the guest kernel used (the runner's LENDVM-CPUINFO lines, CPU 0).
        info = {}
        for l in con.lines:
            m = CPUINFO.search(l)
            if m:
                info.setdefault(m.group(1), m.group(2).strip())
        if info:
            r["guest_cpu"] = info
        cl = next((l for l in con.lines if "Command line:" in l), None)
        if cl is not None:
            r["guest_cmdline"] = cl.split("Command line:", 1)[1].strip()
        return r
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        logf.close()


GSTAT = re.compile(r"LENDVM-FIO gstat i=(\d+) when=(before|after) cpu ((?:\s*\d+)+)")
GIRQ = re.compile(r"LENDVM-FIO girq i=(\d+) when=(before|after)((?: \S+=\d+)*)")
GSTAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def guest_profile(lines, index, ios):
    """The guest's own accounting around fio (the runner's gstat/girq lines): guest CPU
    milliseconds per I/O by kind (USER_HZ = 100, so 10 ms a tick) and interrupts per I/O by
    source. None if the initramfs predates these lines."""
    stat, irq = {}, {}
    for l in lines:
        m = GSTAT.search(l)
        if m and int(m.group(1)) == index:
            stat[m.group(2)] = [int(x) for x in m.group(3).split()]
        m = GIRQ.search(l)
        if m and int(m.group(1)) == index:
            irq[m.group(2)] = dict((k, int(v)) for k, v in (w.split("=") for w in m.group(3).split()))
    if set(stat) != {"before", "after"} or set(irq) != {"before", "after"} or not ios:
        return None
    cpu = {f: 10.0 * (b - a) / ios for f, a, b in zip(GSTAT_FIELDS, stat["before"], stat["after"])}
    irqs = {k: (irq["after"][k] - irq["before"].get(k, 0)) / ios for k in irq["after"]
            if irq["after"][k] != irq["before"].get(k, 0)}
    return {"cpu_ms_per_io": cpu, "irqs_per_io": irqs}


def collect(name, desc, lines, snaps, missing, args, vcpu_names):
    idle_rate = None
    if ("idle", "begin") in snaps and ("idle", "end") in snaps:
        (t0, a, _), (t1, b, _) = snaps[("idle", "begin")], snaps[("idle", "end")]
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
        g = guest_profile(lines, i, ios)
        if g is not None:
            r["guest"] = g
        key = str(i)
        if (key, "begin") in snaps and (key, "end") in snaps and snaps[(key, "begin")][1] is not None:
            (t0, a, ca), (t1, b, cb) = snaps[(key, "begin")], snaps[(key, "end")]
            r["cpu"] = CpuProbe.delta(ca, cb, t1 - t0, vcpu_names)
            delta = {k: b[k] - a[k] for k in COUNTER_KEYS}
            # Every KVM statistic that moved, per I/O (time and histogram statistics left out).
            r["kvm_per_io"] = {k: (b[k] - a[k]) / ios for k in sorted(b)
                               if k in a and b[k] != a[k] and not k.endswith("_ns") and "hist" not in k}
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
    for c in results:
        # Pair with QEMU's boot of the same repetition: the host's load varies by the minute.
        base = next((b for b in results if b["name"] == BASELINE and "error" not in b
                     and b.get("rep") == c.get("rep")), None)
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
           f"{meta['pause_s']} s around each job; {meta.get('cpus', 1)} vCPU(s) per guest; "
           f"lendvm `--cpu-model {meta.get('cpu_model', 'host')}`, QEMU `-cpu {meta.get('qemu_cpu', QEMU_CPU)}`"
           f" with `{meta.get('qemu_append', QEMU_CMDLINE)}`.", ""]
    # The guest kernel's CPU flags where they differ between configurations (CPU 0,
    # /proc/cpuinfo after clearcpuid=/noxsave).
    flags = {label(c, 2): set(c["guest_cpu"].get("flags", "").split())
             for c in results if "error" not in c and c.get("guest_cpu")}
    if flags:
        common = set.intersection(*flags.values())
        out.append(f"Guest CPU flags common to every boot: {len(common)}; beyond them: " + "; ".join(
            f"{k}: {' '.join(sorted(v - common)) or '—'}" for k, v in flags.items()) + ".")
        out.append("")
    for c in results:
        if "error" in c:
            out.append(f"* **{c['name']}** ({c['description']}): **failed**: {c['error']}")
        elif c.get("counters_missing"):
            out.append(f"* {c['name']}: exits n/a, the VMM has no counters endpoint "
                       f"({c['counters_missing'].splitlines()[0]})")
    reps = max((c.get("rep", 1) for c in results), default=1)
    out.append("")
    out.append("| configuration | job | IOPS | MiB/s | clat p50 µs | clat p99 µs | exits/IO | "
               "user-space exits/IO | exits/IO net of idle | user-space net | IOPS ÷ QEMU |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in results:
        if "error" in c:
            continue
        for j in c["jobs"]:
            out.append(
                f"| {label(c, reps)} | {j['job']} | {j['iops']:.0f} | {j['mib_per_s']:.2f} | "
                f"{j['clat_p50_us']:.0f} | {j['clat_p99_us']:.0f} | "
                f"{fmt(j.get('exits_per_io'), '.2f')} | {fmt(j.get('user_exits_per_io'), '.2f')} | "
                f"{fmt(j.get('net_exits_per_io'), '.2f')} | {fmt(j.get('net_user_exits_per_io'), '.2f')} | "
                f"{fmt(j.get('iops_vs_qemu'), '.2f')} |")
    idle = [f"{c['name']} {c['idle_exit_rate_per_s']['exits']:.0f}/s"
            for c in results if "error" not in c and c.get("idle_exit_rate_per_s")]
    if idle:
        out.append("")
        out.append("Idle guest exit rate (subtracted for the *net* columns): " + ", ".join(idle) + ".")
    out += ["", "**Where the CPU went**, per job (`/proc/PID/task/TID/schedstat` and `/proc/stat`, "
            "over the job's window including the runner's pauses): the vCPU thread's CPU in cores; "
            "*vCPU wait* is the share of the vCPU thread's runnable time spent waiting for a core "
            "(another thread had it); the VMM's other threads; the lender process (its busiest "
            "thread); everything else on the host.", "",
            "The guest's columns come from its own /proc/stat and /proc/interrupts just before and "
            "after the fio process (so they include fio's start-up, seconds of emulated kernel time "
            "here): guest seconds in user and in kernel (system+irq+softirq) mode, and the NVMe "
            "queue and local timer (LOC) interrupts per I/O.", "",
            "*KVM per I/O* lists the vCPU statistics (KVM_GET_STATS_FD / query-stats) that moved most "
            "per I/O, after `exits`.", "",
            "| configuration | job | IOPS | vCPU CPU | vCPU wait | VMM other | lender (busiest thread) | rest of host "
            "| guest user s | guest kernel s | non-timer irqs/IO | timer irqs/IO | KVM per I/O |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results:
        if "error" in c:
            continue
        for j in c["jobs"]:
            p = j.get("cpu")
            if p is None:
                continue
            runnable = p["vcpu_cpu"] + p["vcpu_wait"]
            wait = p["vcpu_wait"] / runnable if runnable > 0 else 0.0
            lender = (f"{p['lender_cpu']:.2f} ({p['lender_busiest_thread']})"
                      if p["lender_busiest_thread"] else "—")
            g = j.get("guest")
            if g is None:
                gcols = "n/a | n/a | n/a | n/a"
            else:
                cm, ir = g["cpu_ms_per_io"], g["irqs_per_io"]
                sec = j["ios"] / 1000.0  # ms per I/O -> seconds over the process
                gcols = (f"{(cm['user'] + cm['nice']) * sec:.1f} | "
                         f"{(cm['system'] + cm['irq'] + cm['softirq']) * sec:.1f} | "
                         f"{sum(v for k, v in ir.items() if k != 'LOC'):.2f} | {ir.get('LOC', 0.0):.2f}")
            out.append(f"| {label(c, reps)} | {j['job']} | {j['iops']:.0f} | {p['vcpu_cpu']:.2f} | "
                       f"{100 * wait:.0f} % | {p['vmm_other_cpu']:.2f} | {lender} | {p['host_other_cpu']:.2f} | {gcols} | "
                       f"{top_kvm(j.get('kvm_per_io'))} |")
    return "\n".join(out) + "\n"


def top_kvm(per_io, n=5):
    if not per_io:
        return "n/a"
    top = sorted(((v, k) for k, v in per_io.items() if k != "exits"), reverse=True)[:n]
    return ", ".join(f"{k} {v:.1f}" for v, k in top)


GUEST_PERIOD = 20


def guest_map(args):
    return os.path.join(os.path.dirname(args.vmlinux), "System.map") if args.perf_guest else None


def label(c, reps=2):
    return c["name"] if reps <= 1 else f"{c['name']} #{c.get('rep', 1)}"


def svg(results):
    ok = [c for c in results if "error" not in c]
    reps = max((c.get("rep", 1) for c in results), default=1)
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
                         f'height="{bh:.1f}" fill="{colors[ci % len(colors)]}"><title>{label(c, reps)} '
                         f'{job}: {v:.3g}</title></rect>')
    ly = top + len(panels) * (ph + 60)
    for ci, c in enumerate(ok):
        s.append(f'<rect x="{left}" y="{ly + ci * 16}" width="10" height="10" fill="{colors[ci % len(colors)]}"/>')
        s.append(f'<text x="{left + 16}" y="{ly + ci * 16 + 9}">{label(c, reps)}: {c["description"]}</text>')
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
    if len(sys.argv) >= 3 and sys.argv[1] == "--render":
        # Re-render the Markdown of an earlier run's JSON (e.g. after changing the report).
        with open(sys.argv[2]) as f:
            d = json.load(f)
        print(markdown(d["configs"], d["meta"]), end="")
        return 0
    ap.add_argument("--vmlinux", required=True)
    ap.add_argument("--bzimage", required=True)
    ap.add_argument("--initramfs", required=True)
    ap.add_argument("--bin-dir", required=True, help="directory with lendvm, lenderd, lendctl")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated subset of {', '.join(CONFIGS)}")
    ap.add_argument("--pause", type=int, default=2, help="guest pause around each job, seconds")
    ap.add_argument("--perf", action="store_true",
                    help="perf record the vCPU thread over each job (top host symbols per job)")
    ap.add_argument("--perf-guest", action="store_true",
                    help="sample KVM's emulated guest instructions per job and name the guest "
                    "kernel functions (System.map next to --vmlinux; this PVM host emulates the guest kernel)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="boot every configuration this many times (rounds in turn), to see the spread")
    ap.add_argument("--timeout", type=int, default=1500, help="bound on one boot, seconds")
    ap.add_argument("--cpus", type=int, default=1, help="vCPUs of every guest (lendvm --cpus, QEMU -smp)")
    ap.add_argument("--cpu-model", default="qemu64", choices=["host", "qemu64"],
                    help="lendvm's --cpu-model for the lendvm configurations")
    ap.add_argument("--qemu-cpu", default=QEMU_CPU, help="QEMU's -cpu")
    ap.add_argument("--qemu-append", default=None,
                    help="what QEMU's kernel command line gets for the emulator (default: "
                    f"'{QEMU_CMDLINE}' for qemu64, else '{QEMU_CMDLINE_HOST}')")
    ap.add_argument("--allow-missing-counters", action="store_true",
                    help="report exits as n/a when lendvm has no vm.counters endpoint")
    ap.add_argument("--out", required=True, help="JSON output")
    ap.add_argument("--svg", required=True)
    ap.add_argument("--markdown", help="docs/BENCHMARKS.md to update (between bench-guest markers)")
    ap.add_argument("--svg-rel", default="bench-guest.svg", help="the SVG's path relative to --markdown")
    ap.add_argument("--log-dir", required=True)
    args = ap.parse_args()
    if args.qemu_append is None:
        args.qemu_append = QEMU_CMDLINE if args.qemu_cpu.startswith("qemu64") else QEMU_CMDLINE_HOST
    if args.cpus < 1:
        ap.error("--cpus must be at least 1")
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
        for rep, n in ((r, n) for r in range(1, args.repeat + 1) for n in names):
            t0 = time.time()
            try:
                r = run_config(n, args, os.path.join(work, f"rep{rep}"), rep)
                r["wall_s"] = round(time.time() - t0, 1)
                log(f"{n}: ok in {r['wall_s']} s: " + ", ".join(
                    f"{j['job']} {j['iops']:.0f} IOPS" for j in r["jobs"]))
            except ConfigFailed as e:
                log(f"{n}: FAILED: {e}")
                r = {"name": n, "description": CONFIGS[n][0], "error": str(e)}
            r["rep"] = rep
            results.append(r)
    ratios(results)
    uname = os.uname()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": f"{os.cpu_count()} CPUs, {uname.sysname} {uname.release}",
            "kernel": os.path.basename(os.path.dirname(args.vmlinux)),
            "initramfs": os.path.basename(args.initramfs), "pause_s": args.pause,
            "bin_dir": args.bin_dir, "repeat": args.repeat, "cpus": args.cpus,
            "cpu_model": args.cpu_model, "qemu_cpu": args.qemu_cpu, "qemu_append": args.qemu_append,
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
