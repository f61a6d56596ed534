//! The PF driver's half of NVMe SR-IOV, for L1 (scripts/test-vfio.sh, docs/VFIO.md): what an
//! operator does with nvme-cli's `virt-mgmt` before lending a VF, done through the kernel's
//! admin passthrough (`NVME_IOCTL_ADMIN_CMD`) on the PF's controller, which L1's own nvme
//! driver owns.
//!
//! `lendvm-nvme-sriov PF_BDF NUM_VFS [VQ_PER_VF VI_PER_VF]` (defaults 2 and 1: an admin
//! queue, one I/O queue and one MSI-X vector per VF, as QEMU 7.2's `sriov_vq_flexible` /
//! `sriov_vi_flexible` of 2 and 1 per VF give) runs the steps of QEMU's NVMe documentation:
//!
//! 1. Virtualization Management *Primary Controller Flexible Allocation* of 0 VQ and 0 VI
//!    resources: the flexible resources leave the primary controller;
//! 2. a function-level reset of the PF (sysfs `reset`), which is when they actually leave;
//! 3. `sriov_drivers_autoprobe` 0 (the VFs stay driverless for vfio-pci), `sriov_numvfs` N;
//! 4. for each VF's secondary controller: *Secondary Controller Assign* of VQ and VI
//!    resources, then *Secondary Controller Online*;
//! 5. the Secondary Controller List again: one `LENDVM-SRIOV vf=...` line per VF.
//!
//! Without step 4, QEMU's VF controller fails its enable (CSTS.CFS): a VF has no queues of
//! its own until the PF's driver gives it some. Exit code 1 with the failing step named.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// `struct nvme_passthru_cmd` of `<linux/nvme_ioctl.h>` (72 bytes).
#[repr(C)]
#[derive(Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}

/// `NVME_IOCTL_ADMIN_CMD` = `_IOWR('N', 0x41, struct nvme_admin_cmd)`.
const NVME_IOCTL_ADMIN_CMD: libc::c_ulong =
    (3 << 30) | ((std::mem::size_of::<PassthruCmd>() as libc::c_ulong) << 16) | (0x4e << 8) | 0x41;
const OPC_IDENTIFY: u8 = 0x06;
const OPC_VIRT_MGMT: u8 = 0x1c;
const CNS_CTRL: u32 = 0x01;
const CNS_SECONDARY_LIST: u32 = 0x15;
/// Virtualization Management actions (NVMe 1.4 5.22).
const ACT_PRIMARY_FLEXIBLE: u32 = 0x1;
const ACT_SECONDARY_ASSIGN: u32 = 0x8;
const ACT_SECONDARY_ONLINE: u32 = 0x9;
/// Resource types.
const RT_VQ: u32 = 0;
const RT_VI: u32 = 1;

/// One entry of the Secondary Controller List.
#[derive(Debug)]
struct Secondary {
    scid: u16,
    vfn: u16,
    online: bool,
    nvq: u16,
    nvi: u16,
}

struct Ctrl {
    file: File,
    name: String,
}

impl Ctrl {
    /// The PF's controller character device, found through sysfs (`<pf>/nvme/nvmeN`).
    fn of_pf(pf: &str) -> Result<Self, String> {
        let dir = Path::new("/sys/bus/pci/devices").join(pf).join("nvme");
        let name = std::fs::read_dir(&dir)
            .map_err(|e| format!("{}: {e} (is {pf} bound to nvme?)", dir.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.starts_with("nvme"))
            .ok_or_else(|| format!("{}: no nvme controller", dir.display()))?;
        let path = PathBuf::from("/dev").join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Ctrl { file, name })
    }

    /// One admin command; `data` (if any) is the command's 4 KiB data buffer.
    fn admin(&self, mut cmd: PassthruCmd, data: Option<&mut [u8; 4096]>) -> Result<u32, String> {
        if let Some(d) = data {
            cmd.addr = d.as_mut_ptr() as u64;
            cmd.data_len = d.len() as u32;
        }
        let opcode = cmd.opcode;
        // The controller may still be coming back from the PF's reset: retry for a while.
        let mut last = String::new();
        for _ in 0..50 {
            // SAFETY: `cmd` is a valid `nvme_passthru_cmd` that lives across the call, and
            // its `addr`/`data_len` (when set) describe the caller's buffer, which the kernel
            // writes at most `data_len` bytes of.
            let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), NVME_IOCTL_ADMIN_CMD, &mut cmd) };
            if rc == 0 {
                return Ok(cmd.result);
            }
            if rc > 0 {
                // The NVMe status of a completed command: retrying will not change it.
                return Err(format!(
                    "{}: admin opcode {opcode:#x} completed with status {rc:#x}",
                    self.name
                ));
            }
            last = std::io::Error::last_os_error().to_string();
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!("{}: admin opcode {opcode:#x}: {last}", self.name))
    }

    /// Identify with CNS `cns`: its 4 KiB of data.
    fn identify(&self, cns: u32) -> Result<[u8; 4096], String> {
        let mut d = [0u8; 4096];
        self.admin(
            PassthruCmd {
                opcode: OPC_IDENTIFY,
                cdw10: cns,
                ..Default::default()
            },
            Some(&mut d),
        )?;
        Ok(d)
    }

    fn cntlid(&self) -> Result<u16, String> {
        let d = self.identify(CNS_CTRL)?;
        Ok(u16::from_le_bytes([d[78], d[79]]))
    }

    fn secondaries(&self) -> Result<Vec<Secondary>, String> {
        let d = self.identify(CNS_SECONDARY_LIST)?;
        let n = usize::from(d[0]).min(127);
        Ok((0..n)
            .map(|i| {
                let e = &d[32 + 32 * i..64 + 32 * i];
                let u = |o: usize| u16::from_le_bytes([e[o], e[o + 1]]);
                Secondary {
                    scid: u(0),
                    vfn: u(8),
                    online: e[4] & 1 != 0,
                    nvq: u(10),
                    nvi: u(12),
                }
            })
            .collect())
    }

    fn virt_mgmt(&self, cntlid: u16, rt: u32, act: u32, nr: u16) -> Result<(), String> {
        self.admin(
            PassthruCmd {
                opcode: OPC_VIRT_MGMT,
                cdw10: act | (rt << 8) | (u32::from(cntlid) << 16),
                cdw11: u32::from(nr),
                ..Default::default()
            },
            None,
        )
        .map(|_| ())
        .map_err(|e| format!("virt-mgmt cntlid={cntlid} rt={rt} act={act} nr={nr}: {e}"))
    }
}

fn write_sysfs(pf: &str, attr: &str, value: &str) -> Result<(), String> {
    let p = Path::new("/sys/bus/pci/devices").join(pf).join(attr);
    std::fs::write(&p, value).map_err(|e| format!("echo {value} > {}: {e}", p.display()))
}

fn run(pf: &str, vfs: u16, vq: u16, vi: u16) -> Result<(), String> {
    let ctrl = Ctrl::of_pf(pf)?;
    let pcid = ctrl.cntlid()?;
    println!("LENDVM-SRIOV primary {} cntlid={pcid}", ctrl.name);
    ctrl.virt_mgmt(pcid, RT_VI, ACT_PRIMARY_FLEXIBLE, 0)?;
    ctrl.virt_mgmt(pcid, RT_VQ, ACT_PRIMARY_FLEXIBLE, 0)?;
    write_sysfs(pf, "reset", "1")?;
    write_sysfs(pf, "sriov_drivers_autoprobe", "0")?;
    write_sysfs(pf, "sriov_numvfs", &vfs.to_string())?;
    // The controller is a new open after the reset (the driver re-initialised it).
    let ctrl = Ctrl::of_pf(pf)?;
    let list = ctrl.secondaries()?;
    for n in 1..=vfs {
        let s = list
            .iter()
            .find(|s| s.vfn == n)
            .ok_or_else(|| format!("no secondary controller for VF {n} in {list:?}"))?;
        ctrl.virt_mgmt(s.scid, RT_VQ, ACT_SECONDARY_ASSIGN, vq)?;
        ctrl.virt_mgmt(s.scid, RT_VI, ACT_SECONDARY_ASSIGN, vi)?;
        ctrl.virt_mgmt(s.scid, RT_VQ, ACT_SECONDARY_ONLINE, 0)?;
    }
    let list = ctrl.secondaries()?;
    for s in list.iter().filter(|s| s.vfn >= 1 && s.vfn <= vfs) {
        println!(
            "LENDVM-SRIOV vf={} scid={} online={} nvq={} nvi={}",
            s.vfn,
            s.scid,
            u8::from(s.online),
            s.nvq,
            s.nvi
        );
        if !s.online || s.nvq != vq || s.nvi != vi {
            return Err(format!(
                "VF {} is not online with its resources: {s:?}",
                s.vfn
            ));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |a: &str| -> Result<u16, String> {
        a.parse().map_err(|_| format!("{a:?} is not a number"))
    };
    let result = match args.as_slice() {
        [pf, n] => num(n).map(|n| (pf, n, 2, 1)),
        [pf, n, vq, vi] => (|| Ok((pf, num(n)?, num(vq)?, num(vi)?)))(),
        _ => Err("usage: lendvm-nvme-sriov PF_BDF NUM_VFS [VQ_PER_VF VI_PER_VF]".into()),
    }
    .and_then(|(pf, n, vq, vi)| {
        if n == 0 {
            return Err("NUM_VFS must be at least 1".into());
        }
        run(pf, n, vq, vi)
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lendvm-nvme-sriov: {e}");
            ExitCode::FAILURE
        }
    }
}
