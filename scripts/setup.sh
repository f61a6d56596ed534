#!/usr/bin/env bash
# Installs what lendvm's build, demo and tests need on a fresh Debian machine (run as root).
# Idempotent: a second run only checks.
set -euo pipefail

need_apt=()
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
command -v iptables-legacy >/dev/null 2>&1 || need_apt+=(iptables)
command -v objdump >/dev/null 2>&1 || need_apt+=(binutils)
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
command -v iasl >/dev/null 2>&1 || need_apt+=(acpica-tools)
# etcd-client (the etcd cluster directory) compiles etcd's .proto files at build time: protoc
# and the well-known types (google/protobuf/*.proto).
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || need_apt+=(libprotobuf-dev)
# The directory tests start their own etcd members on loopback (Debian's 3.4, binary `etcd`).
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
# tests/tests/prometheus.rs scrapes lenderd and lendvm with a real Prometheus and lints the
# scrapes with promtool (both in Debian's prometheus).
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
# tests/tests/operator.rs runs `systemd-analyze verify` on the units; scripts/test-packages.sh
# reads the packaged man pages with `man -l`.
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
command -v man >/dev/null 2>&1 || need_apt+=(man-db)
# scripts/test-units.sh traces the daemons' system calls to check the units' filters.
command -v strace >/dev/null 2>&1 || need_apt+=(strace)
# scripts/test-units-live.sh boots systemd in a container to start the units.
command -v systemd-nspawn >/dev/null 2>&1 || need_apt+=(systemd-container)
# scripts/test-vfio.sh (and `scripts/demo.sh --vfio`) boot the lender host "L1" in QEMU with
# an emulated intel-iommu (docs/VFIO.md).
command -v qemu-system-x86_64 >/dev/null 2>&1 || need_apt+=(qemu-system-x86)
# scripts/bench.sh writes its docs/BENCHMARKS.md sections with python3.
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install a stable Rust toolchain (rustup) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
fi

if [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then
  echo "setup: warning: /dev/kvm is not accessible; VM tests will fail" >&2
fi
