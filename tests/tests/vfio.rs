//! Real devices through the real kernel: a Linux guest of lendvm uses a device that vfio-pci
//! owns inside a QEMU guest ("L1") with an emulated intel-iommu, lent by the `lenderd` in L1
//! over the bar fabric (guest RAM inside the ivshmem region that L1 maps as a BAR).
//!
//! `scripts/test-vfio.sh` boots L1 and runs these with `--ignored`, passing what it set up:
//!
//! | variable | what |
//! |---|---|
//! | `LENDVM_VFIO_CLUSTER` | the outer side's cluster file: the L1 node (`fabric = "bar"`, control through QEMU's loopback forward, `region` = the ivshmem file) |
//! | `LENDVM_VFIO_LENDER` | the L1 node's name |
//! | `LENDVM_VFIO_REGION` | the ivshmem file (guest RAM goes inside it) |
//! | `LENDVM_VFIO_NVME` | the NVMe's BDF in L1 |
//! | `LENDVM_VFIO_DISK` | the file behind QEMU's NVMe, on this machine |
//! | `LENDVM_VFIO_VF`, `LENDVM_VFIO_VF_DISK` | the SR-IOV NVMe's VF in L1 (its PF kept by L1's nvme driver), and the file behind its namespace |
//! | `LENDVM_VFIO_NVME_SERIAL`, `LENDVM_VFIO_VF_SERIAL` | their serial numbers (the guest finds its disks by serial: the nvme driver probes in parallel) |
//! | `LENDVM_VFIO_NIC`, `LENDVM_VFIO_NIC_ADDR`, `LENDVM_VFIO_NIC_PEER` | the e1000e's BDF in L1, the guest's address for it, and the address of the NIC that stays in L1 |
//! | `LENDVM_VFIO_L1_CMD`, `LENDVM_VFIO_L1_CONSOLE` | L1's command port (a unix socket: QEMU's second serial port, read by L1's init) and L1's console log |
//! | `LENDVM_VFIO_L1_PID` | QEMU's pid (the L1-death case kills it; the script runs that case last) |
//! | `LENDVM_VFIO_PEER`, `LENDVM_VFIO_PEER_FILE` | an ivshmem-plain function in L1 (a P2P target) and the file behind its 1 MiB BAR 2 |
//! | `LENDVM_VFIO_BIG`, `LENDVM_VFIO_BIG_FILE` | an ivshmem-plain function in L1 with a 16 GiB BAR 2 (a GPU's aperture) and the sparse file behind it |
//! | `LENDVM_LINUX_KERNEL`, `LENDVM_LINUX_INITRAMFS` | the guest kernel and initramfs of the Linux tests |
//! | `LENDVM_LINUX_INITRAMFS_SMALL` (optional) | the initramfs without fio, for the guests that run no fio job |
//! | `LENDVM_VFIO_SLOWNESS` | L1's measured slowness in hundredths (its boot's wall time against the reference, at least 100): every deadline below is scaled by it ([`budget`]) |
//! | `LENDVM_VFIO_CONTROL_PATH` | where the borrowers' control messages go: `ring` (rings in the window) or `tcp` |
//! | `LENDVM_VFIO_ALL_DEVICES` | every function L1's lenderd lends: each case waits until they are all free before it borrows ([`wait_l1_devices_free`]) |
//!
//! A missing variable fails the test with its name (they only run from the script).
//!
//! Deadlines are budgets for a machine of this kind at its reference speed, scaled by L1's
//! measured slowness and never beyond [`SLOWNESS_CEILING`] times the budget: a slow machine
//! gets more time, a hung case still fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{
    VmAddRemoteDeviceData, VmReceiveMigrationData, VmRemoveDeviceData, VmSendMigrationData,
};
use lendvm_tests::capture::ProcessOutput;
use lendvm_tests::crash;

/// Boot plus the case's I/O on a guest whose kernel runs in KVM's instruction emulator, with
/// the lender's device one QEMU further (L1, under TCG by default), at the reference speed.
/// The longest case took 154 s on an idle machine with L1 under TCG: the budget is for a
/// hung case, not a speed target.
const RUN_BUDGET: Duration = Duration::from_secs(8 * 60);
/// The most a deadline is scaled by L1's slowness.
const SLOWNESS_CEILING: f64 = 4.0;
/// From a VM's end (exit or SIGKILL) until L1's lenderd shows its devices available again:
/// the link's end reaches L1 (TCP through QEMU's user network), lenderd returns the lease:
/// VFIO_DEVICE_RESET and the IOMMU unmap of the VM's window, at the reference speed. With L1
/// under TCG this took 0.07-0.2 s on an idle machine (under KVM's instruction emulator, where
/// type1's page-by-page walk of the window ran emulated, tens of seconds: docs/VFIO.md).
const RELEASE_BUDGET: Duration = Duration::from_secs(15);
const FIO_VERIFY_OFFSET: u64 = 8 << 20;
/// Linux guests' RAM (the ivshmem region holds two such guests: a migration's source and
/// destination). Small, because every lease's DMA map makes L1 walk the window page by page
/// (under TCG about a second for 64 MiB; under KVM's instruction emulator 16-50 s:
/// docs/VFIO.md).
const GUEST_RAM_MIB: u64 = 64;
/// The Linux guests' vCPUs: two, because the fio jobs the NVMe cases run (`verify.fio`,
/// `verify-short.fio`) pin one job to each CPU (`cpus_allowed=0`, `=1`): with one vCPU fio
/// refused the job file ("failed parsing cpus_allowed=1") in a run of 2026-11-28. A guest
/// beside L1's vCPU on 2 cores reports RCU stalls; one vCPU did not make the e1000e case
/// faster (372 s against 380 s).
const GUEST_VCPUS: &str = "2";
/// What `verify.fio` covers (two jobs of 256 KiB), and `verify-short.fio` (two of 64 KiB: the
/// runs of the NVMe, e1000e and VF case, where every I/O is a round trip to emulated L1).
const FIO_VERIFY_BYTES: u64 = 512 << 10;
const FIO_VERIFY_SHORT_BYTES: u64 = 128 << 10;
const FIO_VERIFY_BS: u64 = 4096;
const FIO_HDR_MAGIC: u16 = 0xacca;
/// Pings of the lent e1000e to the NIC in L1, 1 s apart (at least one must be answered: L1's
/// one emulated vCPU, busy with a DMA map, answered 2 of 3 in one run and none in another
/// when L1 ran in KVM's emulator; under TCG every one is answered). Five, not ten: each is a
/// second of a boot that CI pays for on every run.
const PINGS: u32 = 5;
/// Blocks acknowledged before the kill is sent (each is one synced write through L1).
const CRASH_ACKS_BEFORE_KILL: u64 = 4;
const CRASH_PASS2_BLOCKS: u64 = 4;
/// The guest's NVMe I/O timeout: a write whose completion never comes fails after it.
const CRASH_NVME_IO_TIMEOUT_S: u64 = 15;
/// From the kill to lendvm's `device-lost`: the end of the control connection reaches lendvm
/// through QEMU's user network (L1's TCP stack, then slirp's socket out here).
const LOST_BOUND: Duration = Duration::from_secs(60);
/// From the kill to the guest writer's error: the NVMe driver's timeout and abort, or the
/// surprise removal, whichever comes first.
const CRASH_ERROR_BOUND: Duration = Duration::from_secs(CRASH_NVME_IO_TIMEOUT_S * 6);

/// `base` scaled by L1's measured slowness (`LENDVM_VFIO_SLOWNESS`, hundredths), within
/// [`SLOWNESS_CEILING`].
fn budget(base: Duration) -> Duration {
    let slow: f64 = env("LENDVM_VFIO_SLOWNESS")
        .parse::<f64>()
        .expect("LENDVM_VFIO_SLOWNESS is hundredths")
        / 100.0;
    base.mul_f64(slow.clamp(1.0, SLOWNESS_CEILING))
}

/// The deadline of a case that starts now.
fn run_deadline() -> Instant {
    Instant::now() + budget(RUN_BUDGET)
}

/// L1's lenderd, asked from out here.
fn l1_lender() -> lending::client::LenderClient {
    l1_lender_as(
        std::path::Path::new(&env("LENDVM_VFIO_CLUSTER")),
        "vfio-tests",
        Duration::from_secs(30),
    )
}

/// L1's lenderd through the cluster file `cluster`, as the client `name`.
fn l1_lender_as(
    cluster: &std::path::Path,
    name: &str,
    timeout: Duration,
) -> lending::client::LenderClient {
    let cluster = ntb::ClusterConfig::load(cluster).unwrap();
    let node = cluster.node(&env("LENDVM_VFIO_LENDER")).unwrap().clone();
    lending::client::LenderClient::connect_node(
        &cluster,
        &node,
        &ntb::NodeId::new(name).unwrap(),
        timeout,
        &env("LENDVM_TOKEN"),
        name,
    )
    .unwrap_or_else(|e| panic!("L1's lenderd: {e}"))
}

/// Waits until L1's lenderd lists every function it lends as available, within `bound`
/// (scaled); fails naming the devices still held and their state. A lenderd that does not
/// answer (killed by a case that failed before restarting it) is started again first.
fn wait_l1_devices_free(bound: Duration, why: &str) -> Duration {
    let bound = budget(bound);
    let t0 = Instant::now();
    let devices = env("LENDVM_VFIO_ALL_DEVICES");
    let mut restarted = false;
    loop {
        let held: Vec<String> = match std::panic::catch_unwind(l1_lender) {
            Ok(c) => c
                .list()
                .unwrap_or_else(|e| panic!("lendctl list on L1: {e}"))
                .into_iter()
                .filter(|d| devices.split(' ').any(|b| b == d.id))
                .filter(|d| d.state != lending::protocol::DeviceState::Available)
                .map(|d| format!("{} {}", d.id, d.state))
                .collect(),
            Err(_) if !restarted => {
                eprintln!("L1's lenderd does not answer: starting it again");
                L1::from_env().command("start-lenderd");
                restarted = true;
                continue;
            }
            Err(_) => vec!["lenderd does not answer".into()],
        };
        if held.is_empty() {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < bound,
            "{why}: L1's lenderd still holds {held:?} after {:?} (bound {bound:?})",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// At a case's start: every device of L1 is free (a case before may have failed).
fn l1_ready() {
    let waited = wait_l1_devices_free(RELEASE_BUDGET, "before the case");
    eprintln!("L1's devices free ({waited:?} waited)");
}

/// After `guest` ended (exited or killed): L1 takes its leases back within the bound.
fn released_after(mut guest: Guest) {
    if guest.status.is_none() {
        let _ = guest.child.kill();
        guest.status = guest.child.wait().ok();
    }
    drop(guest);
    let took = wait_l1_devices_free(RELEASE_BUDGET, "after the VM ended");
    eprintln!("L1 took the leases back {took:?} after the VM ended");
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run this test through scripts/test-vfio.sh, which boots L1")
    })
}

fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let p = dir.join(name);
    assert!(p.exists(), "{} is missing: cargo build --bins", p.display());
    p
}

/// A lendvm running the Linux guest; killed on drop, its console kept next to the tests.
struct Guest {
    name: &'static str,
    child: Child,
    out: ProcessOutput,
    status: Option<ExitStatus>,
}

impl Guest {
    /// lendvm booting the Linux guest, its 64 MiB of RAM at offset 0 of the region.
    fn start(name: &'static str, cmdline_extra: &str, extra: &[&str]) -> Guest {
        Self::start_in(&env("LENDVM_VFIO_CLUSTER"), name, cmdline_extra, extra)
    }

    /// [`Guest::start`] with the cluster file `cluster`.
    fn start_in(cluster: &str, name: &'static str, cmdline_extra: &str, extra: &[&str]) -> Guest {
        // rodata=off: as the Linux cases (tests/tests/linux.rs, `cmdline`).
        let cmdline = format!(
            "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 nokaslr lpj=1000000 \
             rodata=off {cmdline_extra}"
        );
        // A guest that runs no fio job boots the initramfs without fio when there is one
        // (`make-initramfs.sh --small`): 7-11 s less of emulated unpacking before /init.
        let small = std::env::var("LENDVM_LINUX_INITRAMFS_SMALL").unwrap_or_default();
        let initramfs = if cmdline_extra.contains("lendvm_fio=") || small.is_empty() {
            env("LENDVM_LINUX_INITRAMFS")
        } else {
            small
        };
        let kernel = env("LENDVM_LINUX_KERNEL");
        let mut args = vec![
            "--kernel",
            &kernel,
            "--initramfs",
            &initramfs,
            "--cpus",
            GUEST_VCPUS,
            // As the Linux cases (tests/tests/linux.rs, `PCI_SLOTS`): slots enough for the
            // NVMe, the VF and a re-add; fewer ACPI slots for the emulated kernel to boot through.
            "--pci-slots",
            "4",
            "--serial",
            "stdout",
            "--cmdline",
            &cmdline,
        ];
        args.extend_from_slice(extra);
        Self::spawn_in(cluster, name, 0, GUEST_RAM_MIB, &args)
    }

    /// lendvm with `args`, `ram_mib` of RAM at `offset` MiB of the region (a migration
    /// destination sits beside its source, which runs until the switch-over).
    fn spawn(name: &'static str, offset_mib: u64, ram_mib: u64, args: &[&str]) -> Guest {
        Self::spawn_in(&env("LENDVM_VFIO_CLUSTER"), name, offset_mib, ram_mib, args)
    }

    /// [`Guest::spawn`] with the cluster file `cluster`.
    fn spawn_in(
        cluster: &str,
        name: &'static str,
        offset_mib: u64,
        ram_mib: u64,
        args: &[&str],
    ) -> Guest {
        let memory = format!(
            "{ram_mib}M,shared={},offset={offset_mib}M",
            env("LENDVM_VFIO_REGION")
        );
        let mut child = Command::new(binary("lendvm"))
            .args(["--memory", &memory, "--cluster", cluster])
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("LENDVM_LINUX_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = ProcessOutput::capture(&mut child);
        Guest {
            name,
            child,
            out,
            status: None,
        }
    }

    fn diag(&self) -> String {
        self.out.report(&[])
    }

    fn expect_line(&self, needle: &str, deadline: Instant) -> String {
        self.out
            .wait_for(deadline, |lines| {
                lines.iter().find(|(_, l)| l.contains(needle)).cloned()
            })
            .map(|(_, l)| l)
            .unwrap_or_else(|| panic!("no console line with {needle:?}\n{}", self.diag()))
    }

    fn expect_exit_0(&mut self, deadline: Instant) {
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                self.status = Some(s);
                self.out.drain(Duration::from_secs(5));
                assert_eq!(s.code(), Some(0), "lendvm exit\n{}", self.diag());
                // Every process the guest ran again (`LENDVM-FLAKE`) was killed by the
                // emulator's TLS fault, as the kernel reported it (tests/src/flake.rs).
                match lendvm_tests::flake::check(&self.out.lines()) {
                    Ok(0) => {}
                    Ok(n) => println!(
                        "{}: {n} process(es) rerun after the emulator's TLS fault",
                        self.name
                    ),
                    Err(e) => panic!("{e}\n{}", self.diag()),
                }
                return;
            }
            assert!(
                Instant::now() < deadline,
                "lendvm still runs at the deadline\n{}",
                self.diag()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let dir = std::env::current_exe()
            .ok()
            .and_then(|e| Some(e.parent()?.parent()?.join("vfio-tests")));
        if let Some(dir) = dir {
            let _ = std::fs::create_dir_all(&dir);
            let path = dir.join(format!("{}.log", self.name));
            if std::fs::write(&path, self.diag()).is_ok() {
                println!(
                    "{}: console and lendvm log in {}",
                    self.name,
                    path.display()
                );
            }
        }
    }
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    lendvm_tests::fio::field(line, key)
}

/// QEMU's NVMe in L1, owned by vfio-pci there, lent over the bar fabric with the SR-IOV VF
/// of a second NVMe (one boot for both).
///
/// The NVMe: the guest's stock nvme driver binds it and runs fio's crc32c verify job three
/// times: after the first, the host hot-removes the disk, waits for lendvm's
/// `device-released` event (the lease is back at L1, the function reset) and adds it again
/// once, without retrying; after the second, the guest resets the function itself (sysfs
/// `reset`: FLR, which the lender turns into VFIO_DEVICE_RESET). Every block fio wrote is in
/// the file behind QEMU's NVMe, with fio's header naming its own offset.
///
/// The SR-IOV VF: QEMU's NVMe with one VF, whose PF L1's own nvme driver keeps (it gave
/// the VF its queues and vector); the VF is bound to vfio-pci and lent. The guest's stock
/// nvme driver binds it like any NVMe, and a fourth verify run goes to it; its blocks are
/// in the file behind the subsystem's namespace. (L1's vfio_kernel shows the PF refused.)
///
/// The control messages took the path the script chose (rings in the window by default).
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_nvme_and_an_sriov_vf_in_l1_replug_flr_and_fio_verify() {
    l1_ready();
    let lender = env("LENDVM_VFIO_LENDER");
    let bdf = env("LENDVM_VFIO_NVME");
    let disk = PathBuf::from(env("LENDVM_VFIO_DISK"));
    let vf = env("LENDVM_VFIO_VF");
    let vf_disk = PathBuf::from(env("LENDVM_VFIO_VF_DISK"));
    let serial = env("LENDVM_VFIO_NVME_SERIAL");
    let vf_serial = env("LENDVM_VFIO_VF_SERIAL");
    let spec = format!("{lender}:{bdf}");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let mut guest = Guest::start(
        "vfio_nvme_and_an_sriov_vf_in_l1_replug_flr_and_fio_verify",
        &format!(
            "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 \
             lendvm_fio=verify-short@serial:{serial},verify-short@serial:{serial},\
             verify-short@serial:{serial},verify-short@serial:{vf_serial} \
             lendvm_fio_replug=1 lendvm_fio_flr=2"
        ),
        &[
            "--name",
            "vfio-fio",
            "--remote-device",
            &format!("{spec},id=disk0"),
            "--remote-device",
            &format!("{lender}:{vf},id=vf0"),
            "--api-socket",
            socket.to_str().unwrap(),
        ],
    );
    let deadline = run_deadline();
    guest.expect_line("Linux version ", deadline);
    // The stock driver bound QEMU's controller.
    guest.expect_line("nvme nvme0: ", deadline);
    let api = ApiClient::new(&socket, Duration::from_secs(60));

    // Run 1, then the host removes the disk and adds it back once it is released.
    guest.expect_line("LENDVM-FIO replug-wait i=1", deadline);
    let seen = api.events(0).unwrap().len();
    api.remove_device(&VmRemoveDeviceData {
        id: "disk0".into(),
        force: false,
    })
    .unwrap_or_else(|e| panic!("remove: {e}\n{}", guest.diag()));
    let gone = guest.expect_line("LENDVM-FIO replug-gone i=1", deadline);
    assert!(gone.contains("rc=0"), "{gone}\n{}", guest.diag());
    let t0 = Instant::now();
    let bound = budget(RELEASE_BUDGET);
    loop {
        let released = api.events(0).unwrap().into_iter().skip(seen).any(|e| {
            e.event == "device-released"
                && e.properties.get("id").and_then(|v| v.as_str()) == Some("disk0")
        });
        if released {
            break;
        }
        assert!(
            t0.elapsed() < bound,
            "no device-released event for disk0 within {bound:?}\n{}",
            guest.diag()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("disk0 released {:?} after the remove", t0.elapsed());
    let added = api
        .add_remote_device(&VmAddRemoteDeviceData {
            device: spec.parse().unwrap(),
            id: Some("disk1".into()),
            mode: None,
            replace_lost: false,
            numa_node: None,
        })
        .unwrap_or_else(|e| panic!("re-add after device-released: {e}\n{}", guest.diag()));
    eprintln!("re-added: {added:?}");

    // Run 2 on the re-added disk, then the guest's FLR, then run 3; run 4 on the VF.
    let flr = guest.expect_line("LENDVM-FIO flr-done i=2", deadline);
    assert!(flr.contains("rc=0"), "{flr}\n{}", guest.diag());
    let done = guest.expect_line("LENDVM-FIO done ", deadline);
    assert_eq!(
        (field(&done, "runs"), field(&done, "failed")),
        (Some("4"), Some("0")),
        "{done}\n{}",
        guest.diag()
    );
    let lines = guest.out.lines();
    let runs =
        lendvm_tests::fio::parse_runs(&lines).unwrap_or_else(|e| panic!("{e}\n{}", guest.diag()));
    assert_eq!(runs.len(), 4, "{runs:?}");
    for r in &runs {
        assert_eq!(r.rc, "0", "fio's exit code\n{}", guest.diag());
        assert_eq!(r.error().unwrap(), 0, "fio: {:#}", r.json);
    }
    guest.expect_exit_0(deadline);
    // Each disk's blocks are in its own file: runs 1-3 went through the plain NVMe, run 4
    // through the VF (whose PF nobody lent) into the subsystem's namespace.
    assert_fio_blocks_in(&disk, FIO_VERIFY_SHORT_BYTES);
    assert_fio_blocks_in(&vf_disk, FIO_VERIFY_SHORT_BYTES);
    let stderr = guest.out.stderr();
    assert!(
        stderr.contains("on Bar"),
        "the device came over the bar fabric:\n{stderr}"
    );
    let path = env("LENDVM_VFIO_CONTROL_PATH");
    let want = if path == "ring" {
        "control through ring (slot"
    } else {
        "control through tls"
    };
    assert!(
        stderr.contains(want),
        "control path {path}: no {want:?} in lendvm's log:\n{stderr}"
    );
    released_after(guest);
}

/// QEMU's e1000e in L1, owned by vfio-pci there, lent over the bar fabric: the guest's stock
/// e1000e driver binds it, gets carrier, and pings the second e1000e that stays in L1 (both
/// on one QEMU hub; link-local addresses; nothing leaves QEMU). Its descriptor rings and
/// packet buffers are in guest RAM, reached through L1's IOMMU and the BAR window; its
/// interrupts are MSI-X vectors relayed to the guest. A case of its own: its probe and
/// `ip link set up` are hundreds of trapped register accesses, each a round trip to L1.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_e1000e_in_l1_pings_the_nic_that_stays_there() {
    l1_ready();
    let lender = env("LENDVM_VFIO_LENDER");
    let nic = env("LENDVM_VFIO_NIC");
    let peer = env("LENDVM_VFIO_NIC_PEER");
    let addr = env("LENDVM_VFIO_NIC_ADDR");
    let guest = Guest::start(
        "vfio_e1000e_in_l1_pings_the_nic_that_stays_there",
        &format!(
            "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 \
             lendvm_net={addr},{peer},{PINGS}"
        ),
        &[
            "--name",
            "vfio-nic",
            "--remote-device",
            &format!("{lender}:{nic},id=nic0"),
        ],
    );
    let deadline = run_deadline();
    guest.expect_line("Linux version ", deadline);
    let net = guest.expect_line("LENDVM-NET ", deadline);
    assert!(net.contains("LENDVM-NET ok "), "{net}\n{}", guest.diag());
    assert_eq!(field(&net, "driver"), Some("e1000e"), "{net}");
    assert_eq!(
        field(&net, "sent"),
        Some(PINGS.to_string().as_str()),
        "{net}"
    );
    let received: u32 = field(&net, "received").unwrap().parse().unwrap();
    assert!(
        received >= 1,
        "no echo reply from L1's NIC: {net}\n{}",
        guest.diag()
    );
    // The VM is SIGKILLed under its lease (no return of it): L1's lenderd sees the link end
    // and takes the NIC back within the bound, not "lent" to a VM that is gone.
    released_after(guest);
}

/// A GPU-sized aperture through vfio-pci (issue 33, docs/GPU.md): L1's third ivshmem-plain
/// function has a 64-bit prefetchable BAR 2 of 16 GiB, a sparse file out here. L1's lenderd
/// lends it like any vfio-pci function (its BAR mediated: the lender maps the region and
/// serves each access). lendvm places it in the guest's 64-bit window, naturally aligned,
/// past 4 GiB; the Linux guest's kernel keeps that placement, and `barpoke` (mmap of the
/// BAR's sysfs resource file, as a user-space driver does) writes and reads back a word at
/// the BAR's start, 4 GiB in and at its last word. The same words are then in the file out
/// here, at those offsets: each access went guest → lendvm → L1's lenderd → vfio-pci →
/// QEMU's ivshmem → the file.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_16g_bar_in_l1_is_placed_past_4g_and_written_at_both_ends() {
    l1_ready();
    const SEED: u64 = 0x4241_5231;
    let lender = env("LENDVM_VFIO_LENDER");
    let big = env("LENDVM_VFIO_BIG");
    let file = PathBuf::from(env("LENDVM_VFIO_BIG_FILE"));
    let len = std::fs::metadata(&file).unwrap().len();
    assert!(
        len >= 16 << 30,
        "{} is {len} bytes, not 16 GiB",
        file.display()
    );
    let offsets = [0, 1 << 32, len - 8];
    // Zeros where the guest will write: a pattern left by an earlier run proves nothing.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    for &o in &offsets {
        f.write_all_at(&[0u8; 8], o).unwrap();
    }
    let mut guest = Guest::start(
        "vfio_16g_bar_in_l1_is_placed_past_4g_and_written_at_both_ends",
        &format!(
            "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 \
             lendvm_bar=1af4:1110,2,{SEED:#x}"
        ),
        &[
            "--name",
            "vfio-bar",
            "--remote-device",
            &format!("{lender}:{big},id=bar0"),
        ],
    );
    let deadline = run_deadline();
    let line = guest.expect_line("LENDVM-BAR ", deadline);
    if let Err(e) = lendvm_tests::check_bar_placement(&line, len) {
        panic!("the guest's BAR 2: {e}\n{}", guest.diag());
    }
    let lines = guest.out.lines();
    let mut word = [0u8; 8];
    for &o in &offsets {
        let want = lendvm_tests::barpoke_word(SEED, o);
        let poke = lendvm_tests::barpoke_ok_line(SEED, o);
        assert!(
            lines.iter().any(|l| l.contains(&poke)),
            "the guest did not read back {want:#x} at {o:#x} (no `{poke}`)\n{}",
            guest.diag()
        );
        f.read_at(&mut word, o).unwrap();
        assert_eq!(
            u64::from_le_bytes(word),
            want,
            "the file behind the BAR, out here, at {o:#x}"
        );
    }
    guest.expect_exit_0(deadline);
    released_after(guest);
}

/// Every block of a verify job over `bytes` from [`FIO_VERIFY_OFFSET`] is in `disk` (the
/// file behind QEMU's NVMe, out here), with fio's verify header naming its own offset: the
/// data went through L1's IOMMU and device.
fn assert_fio_blocks_in(disk: &std::path::Path, bytes: u64) {
    let data = std::fs::read(disk).unwrap();
    for b in 0..bytes / FIO_VERIFY_BS {
        let off = FIO_VERIFY_OFFSET + b * FIO_VERIFY_BS;
        let h = &data[off as usize..off as usize + 24];
        let magic = u16::from_le_bytes([h[0], h[1]]);
        let at = u64::from_le_bytes(h[16..24].try_into().unwrap());
        assert_eq!(
            (magic, at),
            (FIO_HDR_MAGIC, off),
            "QEMU's NVMe file has no fio verify header for the block at {off:#x}"
        );
    }
}

/// Live migration with the NVMe in L1 under fio verify: the destination lendvm, out here too,
/// has its RAM in the region's second half; the lender drains the device (Bus Master off,
/// Transactions Pending clear) and hands the lease over without a reset, and moves the
/// device's DMA onto the destination's window. The VFIO device has no dirty log, so its
/// whole window counts as dirty and is sent at the final pass after the drain. fio,
/// started on the source, verifies every block on the destination.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_nvme_in_l1_survives_a_live_migration_under_fio_verify() {
    l1_ready();
    let lender = env("LENDVM_VFIO_LENDER");
    let bdf = env("LENDVM_VFIO_NVME");
    let disk = PathBuf::from(env("LENDVM_VFIO_DISK"));
    let dir = tempfile::tempdir().unwrap();
    let (src_sock, dst_sock) = (dir.path().join("src.sock"), dir.path().join("dst.sock"));
    let mig = format!("unix:{}", dir.path().join("mig.sock").display());
    let mut src = Guest::start(
        "vfio_nvme_in_l1_migration-source",
        "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 lendvm_fio=verify@nvme0n1",
        &[
            "--name",
            "vfio-mig-src",
            "--remote-device",
            &format!("{lender}:{bdf},id=disk0"),
            "--api-socket",
            src_sock.to_str().unwrap(),
        ],
    );
    let deadline = run_deadline();
    src.expect_line("LENDVM-FIO run i=1 ", deadline);
    let mut dst = Guest::spawn(
        "vfio_nvme_in_l1_migration-destination",
        GUEST_RAM_MIB,
        GUEST_RAM_MIB,
        &[
            "--name",
            "vfio-mig-dst",
            "--api-socket",
            dst_sock.to_str().unwrap(),
        ],
    );
    let dst_api = ApiClient::new(&dst_sock, Duration::from_secs(60));
    let t0 = Instant::now();
    while dst_api.ping().is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "destination API\n{}",
            dst.diag()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    dst_api
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: mig.clone(),
        })
        .unwrap_or_else(|e| panic!("receive: {e}\n{}", dst.diag()));
    ApiClient::new(&src_sock, Duration::from_secs(600))
        .send_migration(&VmSendMigrationData {
            destination_url: mig,
            local: false,
        })
        .unwrap_or_else(|e| {
            panic!(
                "send: {e}\n--- source\n{}--- destination\n{}",
                src.diag(),
                dst.diag()
            )
        });
    src.expect_exit_0(deadline);
    let done = dst.expect_line("LENDVM-FIO done ", deadline);
    assert_eq!(
        (field(&done, "runs"), field(&done, "failed")),
        (Some("1"), Some("0")),
        "{done}\n--- source\n{}--- destination\n{}",
        src.diag(),
        dst.diag()
    );
    dst.expect_exit_0(deadline);
    let mut lines = src.out.lines();
    lines.extend(dst.out.lines());
    let runs = lendvm_tests::fio::parse_runs(&lines).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0].error().unwrap(), 0, "fio: {:#}", runs[0].json);
    // Handed over, not reset: the destination took the lease as it was.
    let err = dst.out.stderr();
    assert!(err.contains("device not reset"), "{err}");
    assert_fio_blocks_in(&disk, FIO_VERIFY_BYTES);
    drop(src);
    released_after(dst);
}

/// L1 as the tests reach it: its command port and its console.
struct L1 {
    cmd: PathBuf,
    console: PathBuf,
}

impl L1 {
    fn from_env() -> L1 {
        L1 {
            cmd: env("LENDVM_VFIO_L1_CMD").into(),
            console: env("LENDVM_VFIO_L1_CONSOLE").into(),
        }
    }

    fn console_lines(&self, prefix: &str) -> Vec<String> {
        let text = std::fs::read(&self.console).unwrap();
        String::from_utf8_lossy(&text)
            .lines()
            .filter(|l| l.starts_with(prefix))
            .map(str::to_owned)
            .collect()
    }

    /// Sends `cmd` on L1's command port and returns L1's answer (`L1-CMD <cmd> ok ...`).
    fn command(&self, cmd: &str) -> String {
        let prefix = format!("L1-CMD {cmd} ");
        let before = self.console_lines(&prefix).len();
        let mut port = UnixStream::connect(&self.cmd)
            .unwrap_or_else(|e| panic!("L1's command port {}: {e}", self.cmd.display()));
        port.write_all(format!("{cmd}\n").as_bytes()).unwrap();
        let t0 = Instant::now();
        loop {
            if let Some(l) = self.console_lines(&prefix).into_iter().nth(before) {
                assert!(l.starts_with(&format!("{prefix}ok")), "L1: {l}");
                return l;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "L1 did not answer {cmd:?} within 120 s; its console ends:\n{}",
                self.console_lines("")
                    .iter()
                    .rev()
                    .take(30)
                    .rev()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Waits until the block the crash writer writes next has reached `disk` (QEMU's file): the
/// kill then lands while the guest's write is in flight or just completed, not between runs.
fn wait_block_in(disk: &std::path::Path, pass: u32, n: u64, guest: &Guest) {
    let want = crash::block(pass, n);
    let f = std::fs::File::open(disk).unwrap();
    let mut head = vec![0u8; 48];
    let t0 = Instant::now();
    loop {
        f.read_exact_at(&mut head, crash::BASE1 + n * crash::BLOCK)
            .unwrap();
        if head == want[..48] {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "block {n} never reached QEMU's file\n{}",
            guest.diag()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// After the lender side died under a lease: lendvm reports the device lost (in `vm.info`
/// and as a `device-lost` event), the guest's writer gets an error and the disk goes away,
/// every block the guest saw acknowledged is intact in QEMU's file, and once the guest
/// ejected the disk lendvm holds nothing of it. Returns the acknowledged blocks.
fn after_a_lender_death(
    guest: &Guest,
    api: &ApiClient,
    disk: &std::path::Path,
    t_kill: Instant,
    deadline: Instant,
) -> Vec<u64> {
    let mut lost_info = false;
    let mut lost_event = false;
    while t_kill.elapsed() < LOST_BOUND && !(lost_info && lost_event) {
        let info = api
            .info()
            .unwrap_or_else(|e| panic!("vm.info after the kill: {e}\n{}", guest.diag()));
        lost_info |= info
            .remote_devices
            .iter()
            .any(|d| d.id == "disk0" && d.lease_state == api::types::LeaseState::Lost)
            // The guest may have ejected it already.
            || (lost_event && info.remote_devices.is_empty());
        lost_event |= api.events(0).unwrap().iter().any(|e| {
            e.event == "device-lost"
                && e.properties.get("id").and_then(|v| v.as_str()) == Some("disk0")
        });
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        lost_event && lost_info,
        "lendvm did not report disk0 lost within {LOST_BOUND:?} (event {lost_event}, \
         vm.info {lost_info})\n{}",
        guest.diag()
    );
    let err = guest
        .out
        .wait_for(t_kill + CRASH_ERROR_BOUND, |lines| {
            lines
                .iter()
                .find(|(_, l)| l.contains("LENDVM-CRASH error "))
                .cloned()
        })
        .unwrap_or_else(|| {
            panic!(
                "the guest's writer saw no error within {CRASH_ERROR_BOUND:?} of the kill\n{}",
                guest.diag()
            )
        });
    eprintln!("the guest's writer: {}", err.1);
    guest.expect_line("LENDVM-CRASH gone disk=", deadline);
    assert_eq!(api.info().unwrap().state, api::types::VmState::Running);

    let acked = crash::acked(&guest.out.lines());
    assert_eq!(acked, (0..acked.len() as u64).collect::<Vec<_>>());
    assert!(acked.len() as u64 >= CRASH_ACKS_BEFORE_KILL, "{acked:?}");
    let data = std::fs::read(disk).unwrap();
    if let Some((n, what)) = crash::first_lost(&data, &acked) {
        panic!(
            "acknowledged block {n} is not intact in QEMU's file: starts {what}\n{}",
            guest.diag()
        );
    }

    let t0 = Instant::now();
    while !api.info().unwrap().remote_devices.is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the lost disk is still listed: {:?}\n{}",
            api.info(),
            guest.diag()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        api.info().unwrap().counters.unwrap(),
        api::types::VmCounters::default(),
        "resources left after the lost disk was ejected"
    );
    acked
}

/// A guest writing synced blocks to QEMU's NVMe (the crash writer of the guest's init),
/// borrowed from L1 as `disk0`, with its API socket in `dir`; returned once
/// [`CRASH_ACKS_BEFORE_KILL`] blocks were acknowledged and the next one reached `disk`, with
/// the case's deadline.
fn crash_writer(
    name: &'static str,
    dir: &tempfile::TempDir,
    disk: &std::path::Path,
) -> (Guest, ApiClient, Instant) {
    let lender = env("LENDVM_VFIO_LENDER");
    let bdf = env("LENDVM_VFIO_NVME");
    let socket = dir.path().join("api.sock");
    let guest = Guest::start(
        name,
        &format!(
            "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 \
             nvme_core.io_timeout={CRASH_NVME_IO_TIMEOUT_S} \
             lendvm_crash=nvme0n1,4096,{CRASH_PASS2_BLOCKS}"
        ),
        &[
            "--name",
            name,
            "--remote-device",
            &format!("{lender}:{bdf},id=disk0"),
            "--api-socket",
            socket.to_str().unwrap(),
        ],
    );
    let api = ApiClient::new(&socket, Duration::from_secs(60));
    let deadline = run_deadline();
    guest.expect_line("LENDVM-CRASH start disk=nvme0n1", deadline);
    guest.expect_line(
        &format!("LENDVM-CRASH ack block={}", CRASH_ACKS_BEFORE_KILL - 1),
        deadline,
    );
    wait_block_in(disk, 1, CRASH_ACKS_BEFORE_KILL, &guest);
    (guest, api, deadline)
}

/// SIGKILL of L1's lenderd while the guest streams synced writes to QEMU's NVMe: the kernel's
/// vfio-pci release (not lenderd) resets the function and drops its DMA mappings. lendvm
/// stays up and reports the disk lost; the guest's writer gets an error, not a hang; every
/// acknowledged block is in QEMU's file. lenderd starts again in L1, the disk is hot-added
/// again, and a second pass of writes is read back in the guest and found in the file.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_nvme_in_l1_lenderd_killed_mid_write_loses_no_acknowledged_block() {
    l1_ready();
    let l1 = L1::from_env();
    let disk = PathBuf::from(env("LENDVM_VFIO_DISK"));
    let dir = tempfile::tempdir().unwrap();
    let (mut guest, api, deadline) = crash_writer("vfio-lenderd-kill", &dir, &disk);
    let t_kill = Instant::now();
    let answer = l1.command("kill-lenderd");
    eprintln!(
        "L1: {answer} ({:?} after the block reached the file)",
        t_kill.elapsed()
    );
    after_a_lender_death(&guest, &api, &disk, t_kill, deadline);

    // lenderd again in L1; once it lists its devices free, the disk is added again, once.
    l1.command("start-lenderd");
    let waited = wait_l1_devices_free(Duration::from_secs(120), "lenderd's restart");
    eprintln!("L1's lenderd lends again {waited:?} after its restart");
    api.add_remote_device(&VmAddRemoteDeviceData {
        device: format!("{}:{}", env("LENDVM_VFIO_LENDER"), env("LENDVM_VFIO_NVME"))
            .parse()
            .unwrap(),
        id: Some("disk1".into()),
        mode: None,
        replace_lost: false,
        numa_node: None,
    })
    .unwrap_or_else(|e| panic!("re-add after the restart: {e}\n{}", guest.diag()));
    guest.expect_line("LENDVM-CRASH back disk=", deadline);
    let ok = guest.expect_line("LENDVM-CRASH pass2 ", deadline);
    assert!(
        ok.contains(&format!(
            "LENDVM-CRASH pass2 ok blocks={CRASH_PASS2_BLOCKS}"
        )),
        "{ok}\n{}",
        guest.diag()
    );
    guest.expect_exit_0(deadline);
    let data = std::fs::read(&disk).unwrap();
    for n in 0..CRASH_PASS2_BLOCKS {
        let off = (crash::BASE2 + n * crash::BLOCK) as usize;
        assert!(
            data[off..off + crash::BLOCK as usize] == crash::block(2, n)[..],
            "pass-2 block {n} is not in QEMU's file"
        );
    }
    released_after(guest);
}

/// L1 itself dies (QEMU SIGKILLed) while the guest streams synced writes to QEMU's NVMe:
/// the lender host is gone with its IOMMU and device. lendvm stays up and reports the disk
/// lost, the guest's writer gets an error and the disk goes away, every acknowledged block
/// is in QEMU's file (each was flushed before its acknowledgement), and lendvm holds nothing
/// of the device afterwards. The guest RAM in the region's file is unaffected: the guest
/// runs on. `scripts/test-vfio.sh` runs this case last.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh, last"]
fn vfio_l1_dying_mid_lease_leaves_the_vm_running() {
    l1_ready();
    let qemu: i32 = env("LENDVM_VFIO_L1_PID").parse().unwrap();
    let disk = PathBuf::from(env("LENDVM_VFIO_DISK"));
    let dir = tempfile::tempdir().unwrap();
    let (mut guest, api, deadline) = crash_writer("vfio-l1-death", &dir, &disk);
    let t_kill = Instant::now();
    // SAFETY: kill(2) on a pid; no memory is involved.
    let rc = unsafe { libc::kill(qemu, libc::SIGKILL) };
    assert_eq!(
        rc,
        0,
        "kill QEMU {qemu}: {}",
        std::io::Error::last_os_error()
    );
    after_a_lender_death(&guest, &api, &disk, t_kill, deadline);
    // The guest runs on: its writer waits for a disk to come back (none will).
    assert!(
        guest.child.try_wait().unwrap().is_none(),
        "lendvm exited\n{}",
        guest.diag()
    );
    assert!(
        !guest.out.lines().iter().any(|l| l.contains("Kernel panic")),
        "{}",
        guest.diag()
    );
    guest.child.kill().unwrap();
    guest.status = Some(guest.child.wait().unwrap());
}

/// Byte `i` of the block the bare-metal guest's `p2p-nvme` writes (tests/guest/src/p2p.rs).
fn nvme_p2p_byte(seed: u32, i: u64) -> u8 {
    (seed as u64)
        .wrapping_mul(31)
        .wrapping_add(i.wrapping_mul(7)) as u8
        ^ (i >> 8) as u8
}

/// Peer-to-peer between two of L1's functions lent to one VM: QEMU's NVMe reads a block
/// straight into the BAR of a second ivshmem-plain function (plain memory, backed by a file
/// out here). The bare-metal test guest (`tests=p2p-nvme`) writes the block from guest RAM,
/// clears that buffer, and gives the NVMe a read whose only PRP is the peer's BAR address;
/// lendvm's P2P router asks L1's lenderd to map the peer's BAR (its vfio-pci region mmap)
/// into the NVMe's VFIO container at that address, and L1's IOMMU translates the NVMe's
/// writes onto the peer's BAR. The block is then in the peer's file out here and not in
/// guest RAM.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_p2p_nvme_reads_into_a_peer_bar_in_l1() {
    l1_ready();
    const SEED: u32 = 0x5032_504e;
    let lender = env("LENDVM_VFIO_LENDER");
    let nvme = env("LENDVM_VFIO_NVME");
    let peer = env("LENDVM_VFIO_PEER");
    let peer_file = PathBuf::from(env("LENDVM_VFIO_PEER_FILE"));
    let l1 = L1::from_env();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&peer_file)
        .unwrap()
        .write_all_at(&[0u8; 4096], 0)
        .unwrap();
    let logged = l1.console_lines("").len();
    let mut guest = Guest::spawn(
        "vfio_p2p_nvme_reads_into_a_peer_bar_in_l1",
        0,
        16,
        &[
            "--kernel",
            env!("LENDVM_TEST_GUEST"),
            "--cpus",
            "1",
            "--serial",
            "stdout",
            "--cmdline",
            &format!("tests=p2p-nvme seed={SEED:#x} lba=4096"),
            "--name",
            "vfio-p2p",
            "--remote-device",
            &format!("{lender}:{nvme},id=disk0"),
            "--remote-device",
            &format!("{lender}:{peer},id=peer0"),
        ],
    );
    let deadline = run_deadline();
    let probe = guest.expect_line("TEST p2p-nvme-probe ", deadline);
    assert!(probe.contains(" ok "), "{probe}\n{}", guest.diag());
    let line = guest.expect_line("TEST p2p-nvme ", deadline);
    // The peer's memory as the file behind its BAR holds it, out here: where it first
    // differs from the block (if it does) tells a DMA that fell short from a read-back
    // through the trapped BAR that went wrong.
    let data = std::fs::read(&peer_file).unwrap();
    let first_diff = (0..4096u64).find(|&i| data[i as usize] != nvme_p2p_byte(SEED, i));
    let at = |i: u64| {
        let i = i as usize;
        format!("{:02x?}", &data[i..(i + 16).min(data.len())])
    };
    assert!(
        line.contains("TEST p2p-nvme ok "),
        "{line}; the peer's file out here {}\n{}",
        match first_diff {
            None => "holds the whole block".to_string(),
            Some(i) => format!(
                "differs first at +{i:#x}: {} (want {:02x?})",
                at(i),
                (i..i + 16)
                    .map(|j| nvme_p2p_byte(SEED, j))
                    .collect::<Vec<_>>()
            ),
        },
        guest.diag()
    );
    guest.expect_exit_0(deadline);
    assert_eq!(
        first_diff,
        None,
        "the peer's file differs from the block at that offset: {}",
        first_diff.map(at).unwrap_or_default()
    );
    // L1's lenderd mapped the peer's BAR 2 into the NVMe's container (lending::iommu::p2p).
    let lender_lines = l1.console_lines("");
    let map = lender_lines[logged..]
        .iter()
        .find(|l| l.contains("bar 2 of lease") && l.contains("(peer-to-peer)"));
    assert!(
        map.is_some(),
        "L1's lenderd logged no peer-to-peer map of BAR 2:\n{}",
        lender_lines[logged..].join("\n")
    );
    released_after(guest);
}

/// Percentile `p` (0..=100) of sorted `v`.
fn pct(v: &[f64], p: usize) -> f64 {
    v[(v.len() - 1) * p / 100]
}

/// The benchmark of L1's control paths (`scripts/bench-l1.sh`, not CI): for each path
/// (`control_path = "tcp"`, then `"ring"`), the round trip of a status request from out here
/// to L1's lenderd and back, then one `verify-short` fio job in a guest on QEMU's NVMe in L1:
/// its seconds, its I/Os and the trapped accesses of the lent NVMe per I/O. Writes
/// `$LENDVM_VFIO_BENCH_OUT/l1-control-$LENDVM_L1_LENDERD_PROFILE.json`.
#[test]
#[ignore = "benchmark: scripts/bench-l1.sh"]
fn bench_l1_control_paths() {
    let out = PathBuf::from(env("LENDVM_VFIO_BENCH_OUT"));
    let profile = env("LENDVM_L1_LENDERD_PROFILE");
    let rounds: usize =
        std::env::var("LENDVM_BENCH_QUICK").map_or(200, |q| if q == "1" { 20 } else { 200 });
    let text = std::fs::read_to_string(env("LENDVM_VFIO_CLUSTER")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let serial = env("LENDVM_VFIO_NVME_SERIAL");
    let mut results = Vec::new();
    for path in ["tcp", "ring"] {
        let cluster = dir.path().join(format!("cluster-{path}.toml"));
        let body: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("control_path"))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
            + &format!("control_path = \"{path}\"\n");
        ntb::config::write_private_file(&cluster, &body).unwrap();
        let token_src = std::path::Path::new(&env("LENDVM_VFIO_CLUSTER"))
            .parent()
            .unwrap()
            .join("token");
        std::fs::copy(&token_src, dir.path().join("token")).unwrap();

        // Round trips of a status request (lendctl status's), after a warm-up.
        l1_ready();
        let c = l1_lender_as(&cluster, "vfio-bench", Duration::from_secs(60));
        let control = c.endpoint().control_path().to_string();
        assert_eq!(
            control.starts_with("ring"),
            path == "ring",
            "asked for {path}, got {control}"
        );
        for _ in 0..5 {
            c.status().unwrap();
        }
        let mut rtt: Vec<f64> = (0..rounds)
            .map(|_| {
                let t = Instant::now();
                c.status().unwrap();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        drop(c);
        rtt.sort_by(f64::total_cmp);
        let mean = rtt.iter().sum::<f64>() / rtt.len() as f64;

        // One fio job on the NVMe.
        l1_ready();
        let name: &'static str = if path == "ring" {
            "bench_l1_fio-ring"
        } else {
            "bench_l1_fio-tcp"
        };
        let mut guest = Guest::start_in(
            cluster.to_str().unwrap(),
            name,
            &format!(
                "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 \
                 lendvm_fio=verify-short@serial:{serial}"
            ),
            &[
                "--name",
                name,
                "--remote-device",
                &format!(
                    "{}:{},id=disk0",
                    env("LENDVM_VFIO_LENDER"),
                    env("LENDVM_VFIO_NVME")
                ),
            ],
        );
        let deadline = run_deadline();
        guest.expect_line("LENDVM-FIO done ", deadline);
        guest.expect_exit_0(deadline);
        let timed = guest.out.timed_lines();
        let at = |needle: &str| {
            timed
                .iter()
                .find(|(_, l)| l.contains(needle))
                .map(|(t, _)| t.as_secs_f64())
                .unwrap_or_else(|| panic!("no {needle:?} on the console"))
        };
        let (boot, t_run, t_done) = (
            at("Linux version "),
            at("LENDVM-FIO run i=1"),
            at("LENDVM-FIO done "),
        );
        let runs = lendvm_tests::fio::parse_runs(&guest.out.lines()).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].error().unwrap(), 0, "fio: {:#}", runs[0].json);
        // Every job of the run (verify-short has two, one per CPU).
        let ios: u64 = runs[0].json["jobs"]
            .as_array()
            .expect("fio's JSON has jobs")
            .iter()
            .flat_map(|job| ["read", "write"].map(|d| job[d]["total_ios"].as_u64().unwrap_or(0)))
            .sum();
        assert!(ios > 0, "fio did no I/O: {:#}", runs[0].json);
        let stderr = guest.out.stderr();
        let trapped: u64 = stderr
            .lines()
            .find_map(|l| {
                let r = l.split("(trapped reads ").nth(1)?;
                let reads: u64 = r.split(',').next()?.parse().ok()?;
                let w = l.split("trapped writes ").nth(1)?;
                let writes: u64 = w.split([',', ')']).next()?.parse().ok()?;
                Some(reads + writes)
            })
            .unwrap_or_else(|| panic!("lendvm logged no trapped-access counts:\n{stderr}"));
        released_after(guest);
        let r = serde_json::json!({
            "path": path,
            "rtt_ms": { "p50": pct(&rtt, 50), "p99": pct(&rtt, 99), "mean": mean, "n": rtt.len() },
            "guest_boot_to_fio_s": t_run - boot,
            "fio_job_s": t_done - t_run,
            "fio_ios": ios,
            "trapped_accesses": trapped,
            "trapped_per_io": trapped as f64 / ios.max(1) as f64,
        });
        eprintln!("bench {profile} {path}: {r}");
        results.push(r);
    }
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join(format!("l1-control-{profile}.json"));
    std::fs::write(
        &file,
        serde_json::to_string_pretty(&serde_json::json!({
            "lenderd_profile": profile,
            "slowness": env("LENDVM_VFIO_SLOWNESS"),
            "results": results,
        }))
        .unwrap(),
    )
    .unwrap();
    eprintln!("wrote {}", file.display());
}
