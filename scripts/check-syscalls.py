#!/usr/bin/env python3
"""Checks the units' SystemCallFilter= against the system calls the daemons really make.

    scripts/check-syscalls.py TRACE_DIR UNIT_DIR

TRACE_DIR holds `strace -ff -o TRACE_DIR/t` output of a run in which lenderd and lendvm
served and ran a VM with lent devices (scripts/test-syscalls.sh). Each traced thread is
attributed to the program its process last executed (threads and forked children inherit
their parent's). For lenderd (resources/systemd/lenderd.service) and lendvm
(lendvm@.service), every system call made must be in the unit's filter as systemd resolves
it (`systemd-analyze syscall-filter`, groups expanded, `~` lines removed). A call outside it
would fail with the unit's SystemCallErrorNumber= under systemd, where CI cannot start the
units (no systemd as PID 1), so it fails here, by name. Prints what each daemon used.
"""

import os
import re
import subprocess
import sys

DAEMONS = {"lenderd": "lenderd.service", "lendvm": "lendvm@.service"}

_groups = {}


def expand(name):
    """The system calls of `name` (a group, recursively, or one call)."""
    if not name.startswith("@"):
        return {name}
    if name not in _groups:
        out = subprocess.run(
            ["systemd-analyze", "syscall-filter", name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        calls = set()
        for line in out.splitlines()[1:]:
            item = line.strip()
            if not item or item.startswith("#"):
                continue
            calls |= expand(item)
        if not calls:
            sys.exit(f"check-syscalls: systemd-analyze knows no group {name}")
        _groups[name] = calls
    return _groups[name]


def allowed(unit_path):
    allow, deny, seen = set(), set(), False
    with open(unit_path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("SystemCallFilter="):
                continue
            seen = True
            value = line[len("SystemCallFilter="):]
            target = allow
            if value.startswith("~"):
                target, value = deny, value[1:]
            for item in value.split():
                target |= expand(item)
    if not seen:
        sys.exit(f"check-syscalls: {unit_path} has no SystemCallFilter=")
    return allow - deny


CALL = re.compile(r"^(?:<\.\.\. )?([a-z_0-9]+)[( ]")
EXEC = re.compile(r'^execve\("([^"]+)".* = 0$')
CHILD = re.compile(r"^(?:clone3?|fork|vfork)\(.* = (\d+)$")
RESUMED_CHILD = re.compile(r"^<\.\.\. (?:clone3?|fork|vfork) resumed>.* = (\d+)$")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    trace_dir, unit_dir = sys.argv[1], sys.argv[2]
    parent, image, calls = {}, {}, {}
    files = [f for f in os.listdir(trace_dir) if re.fullmatch(r"t\.\d+", f)]
    if not files:
        sys.exit(f"check-syscalls: no strace output in {trace_dir}")
    for name in files:
        pid = int(name.split(".")[1])
        used = calls.setdefault(pid, set())
        with open(os.path.join(trace_dir, name), errors="replace") as f:
            for line in f:
                line = line.rstrip("\n")
                m = EXEC.match(line)
                if m:
                    image[pid] = os.path.basename(m.group(1))
                    # What ran before the exec was the parent's program.
                    used.clear()
                    continue
                m = CHILD.match(line) or RESUMED_CHILD.match(line)
                if m:
                    parent[int(m.group(1))] = pid
                m = CALL.match(line)
                if m and m.group(1) not in ("exit", "exited", "killed"):
                    used.add(m.group(1))

    def program(pid):
        for _ in range(1000):
            if pid in image:
                return image[pid]
            if pid not in parent:
                return None
            pid = parent[pid]
        return None

    by_daemon = {d: set() for d in DAEMONS}
    for pid, used in calls.items():
        p = program(pid)
        if p in by_daemon:
            by_daemon[p] |= used
    failed = False
    for daemon, unit in DAEMONS.items():
        used = by_daemon[daemon]
        if not used:
            print(f"check-syscalls: {daemon} never ran in the trace", file=sys.stderr)
            failed = True
            continue
        ok = allowed(os.path.join(unit_dir, unit))
        refused = sorted(used - ok)
        print(f"check-syscalls: {daemon}: {len(used)} system calls: {' '.join(sorted(used))}")
        if refused:
            print(
                f"check-syscalls: {daemon} makes calls that {unit}'s SystemCallFilter= "
                f"refuses: {' '.join(refused)}",
                file=sys.stderr,
            )
            failed = True
        else:
            print(f"check-syscalls: {daemon}: every call is allowed by {unit}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
