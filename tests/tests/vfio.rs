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
//! | `LENDVM_LINUX_KERNEL`, `LENDVM_LINUX_INITRAMFS` | the guest kernel and initramfs of the Linux tests |
//!
//! A missing variable fails the test with its name (they only run from the script).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{
    VmAddRemoteDeviceData, VmReceiveMigrationData, VmRemoveDeviceData, VmSendMigrationData,
};
use lendvm_tests::capture::ProcessOutput;

/// Boot plus fio on a guest whose kernel runs in KVM's instruction emulator, with the lender's
/// device two levels down (L1 is emulated too): generous.
const RUN_TIMEOUT: Duration = Duration::from_secs(12 * 60);
const FIO_VERIFY_OFFSET: u64 = 8 << 20;
/// Guest RAM (the ivshmem region holds two such guests: a migration's source and destination).
const GUEST_RAM_MIB: u64 = 128;
const FIO_VERIFY_BYTES: u64 = 512 << 10;
const FIO_VERIFY_BS: u64 = 4096;
const FIO_HDR_MAGIC: u16 = 0xacca;

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
    /// lendvm booting the Linux guest, its 128 MiB of RAM at offset 0 of the region.
    fn start(name: &'static str, cmdline_extra: &str, extra: &[&str]) -> Guest {
        let cmdline = format!(
            "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 nokaslr lpj=1000000 \
             {cmdline_extra}"
        );
        let (kernel, initramfs) = (env("LENDVM_LINUX_KERNEL"), env("LENDVM_LINUX_INITRAMFS"));
        let mut args = vec![
            "--kernel",
            &kernel,
            "--initramfs",
            &initramfs,
            "--cpus",
            "2",
            "--serial",
            "stdout",
            "--cmdline",
            &cmdline,
        ];
        args.extend_from_slice(extra);
        Self::spawn(name, 0, &args)
    }

    /// lendvm with `args`, its RAM at `offset` MiB of the region (a migration destination
    /// sits beside its source, which runs until the switch-over).
    fn spawn(name: &'static str, offset_mib: u64, args: &[&str]) -> Guest {
        let memory = format!(
            "{GUEST_RAM_MIB}M,shared={},offset={offset_mib}M",
            env("LENDVM_VFIO_REGION")
        );
        let mut child = Command::new(binary("lendvm"))
            .args([
                "--memory",
                &memory,
                "--cluster",
                &env("LENDVM_VFIO_CLUSTER"),
            ])
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
        let console: String = self
            .out
            .timed_lines()
            .iter()
            .map(|(t, l)| format!("{:7.2} {l}\n", t.as_secs_f64()))
            .collect();
        format!(
            "--- console\n{console}--- lendvm stderr\n{}",
            self.out.stderr()
        )
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

/// QEMU's NVMe in L1, owned by vfio-pci there, lent over the bar fabric. The guest's stock
/// nvme driver binds it and runs fio's crc32c verify job three times: after the first, the
/// host hot-removes the disk and adds it again (a new lease, VFIO_DEVICE_RESET on the old
/// one's return); after the second, the guest resets the function itself (sysfs `reset`:
/// FLR, which the lender turns into VFIO_DEVICE_RESET). Every block fio wrote is in the file
/// behind QEMU's NVMe, with fio's header naming its own offset.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_nvme_in_l1_fio_verify_replug_and_flr() {
    let lender = env("LENDVM_VFIO_LENDER");
    let bdf = env("LENDVM_VFIO_NVME");
    let disk = PathBuf::from(env("LENDVM_VFIO_DISK"));
    let spec = format!("{lender}:{bdf}");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let mut guest = Guest::start(
        "vfio_nvme_in_l1_fio_verify_replug_and_flr",
        "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 \
         lendvm_fio=verify@nvme0n1,verify@nvme0n1,verify@nvme0n1 lendvm_fio_replug=1 \
         lendvm_fio_flr=2",
        &[
            "--name",
            "vfio-fio",
            "--remote-device",
            &format!("{spec},id=disk0"),
            "--api-socket",
            socket.to_str().unwrap(),
        ],
    );
    let deadline = Instant::now() + RUN_TIMEOUT;
    guest.expect_line("Linux version ", deadline);
    // The stock driver bound QEMU's controller.
    guest.expect_line("nvme nvme0: ", deadline);
    let api = ApiClient::new(&socket, Duration::from_secs(60));

    // Run 1, then the host removes the disk and adds it back.
    guest.expect_line("LENDVM-FIO replug-wait i=1", deadline);
    api.remove_device(&VmRemoveDeviceData {
        id: "disk0".into(),
        force: false,
    })
    .unwrap_or_else(|e| panic!("remove: {e}\n{}", guest.diag()));
    let gone = guest.expect_line("LENDVM-FIO replug-gone i=1", deadline);
    assert!(gone.contains("rc=0"), "{gone}\n{}", guest.diag());
    // The lender takes the old lease back (and resets the function) before the new borrow.
    let t0 = Instant::now();
    let added = loop {
        match api.add_remote_device(&VmAddRemoteDeviceData {
            device: spec.parse().unwrap(),
            id: Some("disk1".into()),
            mode: None,
            replace_lost: false,
        }) {
            Ok(d) => break d,
            Err(e) if t0.elapsed() < Duration::from_secs(120) => {
                eprintln!("re-add: {e}; retrying");
                std::thread::sleep(Duration::from_secs(2));
            }
            Err(e) => panic!("re-add: {e}\n{}", guest.diag()),
        }
    };
    eprintln!("re-added: {added:?}");

    // Run 2 on the re-added disk, then the guest's FLR, then run 3.
    let flr = guest.expect_line("LENDVM-FIO flr-done i=2", deadline);
    assert!(flr.contains("rc=0"), "{flr}\n{}", guest.diag());
    let done = guest.expect_line("LENDVM-FIO done ", deadline);
    assert_eq!(
        (field(&done, "runs"), field(&done, "failed")),
        (Some("3"), Some("0")),
        "{done}\n{}",
        guest.diag()
    );
    let lines = guest.out.lines();
    let runs =
        lendvm_tests::fio::parse_runs(&lines).unwrap_or_else(|e| panic!("{e}\n{}", guest.diag()));
    assert_eq!(runs.len(), 3, "{runs:?}");
    for r in &runs {
        assert_eq!(r.rc, "0", "fio's exit code\n{}", guest.diag());
        assert_eq!(r.error().unwrap(), 0, "fio: {:#}", r.json);
    }
    guest.expect_exit_0(deadline);
    assert_fio_blocks_in(&disk);
    let stderr = guest.out.stderr();
    assert!(
        stderr.contains("on Bar"),
        "the device came over the bar fabric:\n{stderr}"
    );
}

/// QEMU's e1000e in L1, owned by vfio-pci there, lent over the bar fabric: the guest's stock
/// e1000e driver binds it, gets carrier, and pings the second e1000e that stays in L1 (both on
/// one QEMU hub; link-local addresses; nothing leaves QEMU). Its descriptor rings and packet
/// buffers are in guest RAM, reached through L1's IOMMU and the BAR window; its interrupts
/// are MSI-X vectors relayed to the guest.
#[test]
#[ignore = "needs L1 (QEMU with intel-iommu and lenderd): scripts/test-vfio.sh"]
fn vfio_e1000e_in_l1_pings_through_the_window() {
    let lender = env("LENDVM_VFIO_LENDER");
    let bdf = env("LENDVM_VFIO_NIC");
    let peer = env("LENDVM_VFIO_NIC_PEER");
    let addr = env("LENDVM_VFIO_NIC_ADDR");
    let dev = format!("{lender}:{bdf},id=nic0");
    let mut guest = Guest::start(
        "vfio_e1000e_in_l1_pings_through_the_window",
        &format!(
            "rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4 lendvm_net={addr},{peer},3"
        ),
        &["--name", "vfio-nic", "--remote-device", &dev],
    );
    let deadline = Instant::now() + RUN_TIMEOUT;
    let net = guest.expect_line("LENDVM-NET ", deadline);
    assert!(net.contains("LENDVM-NET ok "), "{net}\n{}", guest.diag());
    assert_eq!(field(&net, "driver"), Some("e1000e"), "{net}");
    assert_eq!(field(&net, "sent"), Some("3"), "{net}");
    let received: u32 = field(&net, "received").unwrap().parse().unwrap();
    assert!(
        received >= 1,
        "no echo reply from L1's NIC: {net}\n{}",
        guest.diag()
    );
    guest.expect_exit_0(deadline);
}

/// Every block of the verify job is in `disk` (the file behind QEMU's NVMe, out here), with
/// fio's verify header naming its own offset: the data went through L1's IOMMU and device.
fn assert_fio_blocks_in(disk: &std::path::Path) {
    let data = std::fs::read(disk).unwrap();
    for b in 0..FIO_VERIFY_BYTES / FIO_VERIFY_BS {
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
    let deadline = Instant::now() + RUN_TIMEOUT;
    src.expect_line("LENDVM-FIO run i=1 ", deadline);
    let mut dst = Guest::spawn(
        "vfio_nvme_in_l1_migration-destination",
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
    assert_fio_blocks_in(&disk);
}
