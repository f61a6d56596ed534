//! Kernel loading: ELF (vmlinux or the test guest) and bzImage, `boot_params`, e820, command
//! line and initramfs, per the boot contract in `docs/CONTRACTS.md`.

use std::fs::File;
use std::path::{Path, PathBuf};

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::{self, BzImage, Cmdline, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{Bytes, GuestAddress};

use crate::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, EBDA_START, HIGH_MEMORY_START, PCI_ECAM_SIZE, PCI_ECAM_START,
    ZERO_PAGE_START,
};
use crate::memory::{GuestMemory, RamRegion};

/// e820 type: usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 type: reserved.
pub const E820_RESERVED: u32 = 2;

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;
/// 64-bit entry of a bzImage, relative to its protected-mode code start.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;

/// Errors of kernel loading.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error("cannot open kernel {path}")]
    OpenKernel {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kernel {path} is neither an ELF image nor a bzImage")]
    Format {
        path: PathBuf,
        elf: loader::Error,
        bz: loader::Error,
    },
    #[error("cannot load kernel {path}")]
    Load {
        path: PathBuf,
        #[source]
        source: loader::Error,
    },
    #[error("kernel command line is invalid: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    #[error("cannot write the kernel command line at {CMDLINE_START:#x}: {0}")]
    CmdlineWrite(loader::Error),
    #[error("cannot read initramfs {path}")]
    Initramfs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("initramfs of {size:#x} bytes does not fit between the kernel end {kernel_end:#x} and {limit:#x}")]
    InitramfsTooBig {
        size: u64,
        kernel_end: u64,
        limit: u64,
    },
    #[error("cannot write {what} to guest memory")]
    GuestWrite { what: &'static str },
}

/// Where the kernel was put.
#[derive(Clone, Copy, Debug)]
pub struct LoadedKernel {
    /// 64-bit entry point (RIP).
    pub entry: u64,
    /// First byte after the kernel image.
    pub kernel_end: u64,
    /// Whether the image was a bzImage.
    pub bzimage: bool,
}

/// Kernel, command line and optional initramfs to boot.
#[derive(Clone, Debug)]
pub struct BootSource<'a> {
    pub kernel: &'a Path,
    pub cmdline: &'a str,
    pub initramfs: Option<&'a Path>,
    /// Written to `boot_params.acpi_rsdp_addr` (boot protocol 2.14) when set.
    pub acpi_rsdp_addr: Option<u64>,
}

/// e820 map for the RAM regions: low RAM minus the EBDA/legacy hole, high RAM, ECAM reserved.
pub fn e820_map(regions: &[RamRegion]) -> Vec<boot_e820_entry> {
    let mut map = Vec::new();
    let entry = |addr: u64, size: u64, kind: u32| boot_e820_entry {
        addr,
        size,
        r#type: kind,
    };
    for r in regions {
        if r.gpa == 0 {
            map.push(entry(0, EBDA_START, E820_RAM));
            if r.size > HIGH_MEMORY_START {
                map.push(entry(
                    HIGH_MEMORY_START,
                    r.size - HIGH_MEMORY_START,
                    E820_RAM,
                ));
            }
        } else {
            map.push(entry(r.gpa, r.size, E820_RAM));
        }
    }
    map.push(entry(PCI_ECAM_START, PCI_ECAM_SIZE, E820_RESERVED));
    map.sort_by_key(|e| e.addr);
    map
}

fn load_image(mem: &GuestMemory, path: &Path) -> Result<(KernelLoaderResult, bool), LoaderError> {
    let open = || {
        File::open(path).map_err(|source| LoaderError::OpenKernel {
            path: path.to_owned(),
            source,
        })
    };
    let highmem = Some(GuestAddress(HIGH_MEMORY_START));
    let elf = match Elf::load(mem, None, &mut open()?, highmem) {
        Ok(r) => return Ok((r, false)),
        Err(loader::Error::Elf(loader::elf::Error::InvalidElfMagicNumber)) => {
            loader::Error::Elf(loader::elf::Error::InvalidElfMagicNumber)
        }
        Err(source) => {
            return Err(LoaderError::Load {
                path: path.to_owned(),
                source,
            })
        }
    };
    match BzImage::load(mem, None, &mut open()?, highmem) {
        Ok(r) => Ok((r, true)),
        Err(loader::Error::Bzimage(loader::bzimage::Error::InvalidBzImage)) => {
            Err(LoaderError::Format {
                path: path.to_owned(),
                elf,
                bz: loader::Error::Bzimage(loader::bzimage::Error::InvalidBzImage),
            })
        }
        Err(source) => Err(LoaderError::Load {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Loads the kernel, command line, initramfs and `boot_params` into guest memory.
pub fn load(
    mem: &GuestMemory,
    regions: &[RamRegion],
    src: &BootSource<'_>,
) -> Result<LoadedKernel, LoaderError> {
    let (result, bzimage) = load_image(mem, src.kernel)?;
    let entry = if bzimage {
        result.kernel_load.0 + BZIMAGE_64BIT_ENTRY_OFFSET
    } else {
        result.kernel_load.0
    };

    let cmdline = Cmdline::try_from(src.cmdline, CMDLINE_MAX_SIZE).map_err(LoaderError::Cmdline)?;
    loader::load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline)
        .map_err(LoaderError::CmdlineWrite)?;

    let mut hdr = result.setup_header.unwrap_or(setup_header {
        boot_flag: KERNEL_BOOT_FLAG_MAGIC,
        header: KERNEL_HDR_MAGIC,
        kernel_alignment: KERNEL_MIN_ALIGNMENT,
        ..Default::default()
    });
    hdr.type_of_loader = KERNEL_LOADER_OTHER;
    hdr.cmd_line_ptr = CMDLINE_START as u32;
    hdr.cmdline_size = src.cmdline.len() as u32 + 1;

    if let Some(path) = src.initramfs {
        let data = std::fs::read(path).map_err(|source| LoaderError::Initramfs {
            path: path.to_owned(),
            source,
        })?;
        let size = data.len() as u64;
        let low_end = regions
            .iter()
            .find(|r| r.gpa == 0)
            .map(|r| r.size)
            .unwrap_or(0);
        let max = if hdr.initrd_addr_max != 0 {
            u64::from(hdr.initrd_addr_max) + 1
        } else {
            0x8000_0000
        };
        let limit = low_end.min(max);
        let addr = limit.saturating_sub(size) & !0xfff;
        if size > limit || addr < result.kernel_end {
            return Err(LoaderError::InitramfsTooBig {
                size,
                kernel_end: result.kernel_end,
                limit,
            });
        }
        mem.write_slice(&data, GuestAddress(addr))
            .map_err(|_| LoaderError::GuestWrite { what: "initramfs" })?;
        hdr.ramdisk_image = addr as u32;
        hdr.ramdisk_size = size as u32;
        log::debug!(
            "initramfs {} at {addr:#x} ({size:#x} bytes)",
            path.display()
        );
    }

    let mut params = boot_params {
        hdr,
        ..Default::default()
    };
    if let Some(rsdp) = src.acpi_rsdp_addr {
        params.acpi_rsdp_addr = rsdp;
    }
    let map = e820_map(regions);
    for (slot, e) in params.e820_table.iter_mut().zip(map.iter()) {
        *slot = *e;
    }
    params.e820_entries = map.len() as u8;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))
        .map_err(|_| LoaderError::GuestWrite {
            what: "boot_params",
        })?;
    log::debug!(
        "kernel {} loaded ({}), entry {entry:#x}, end {:#x}",
        src.kernel.display(),
        if bzimage { "bzImage" } else { "ELF" },
        result.kernel_end
    );
    Ok(LoadedKernel {
        entry,
        kernel_end: result.kernel_end,
        bzimage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ram_regions;

    #[test]
    fn e820_skips_legacy_hole_and_reserves_ecam() {
        let map = e820_map(&ram_regions(5 << 30));
        let v: Vec<(u64, u64, u32)> = map.iter().map(|e| (e.addr, e.size, e.r#type)).collect();
        assert_eq!(
            v,
            vec![
                (0, 0x9fc00, E820_RAM),
                (0x10_0000, 0xc000_0000 - 0x10_0000, E820_RAM),
                (0xe000_0000, 0x1000_0000, E820_RESERVED),
                (1 << 32, (5 << 30) - 0xc000_0000, E820_RAM),
            ]
        );
    }

    #[test]
    fn rejects_a_file_that_is_no_kernel() {
        let ram = crate::memory::GuestRam::new(16 << 20).unwrap();
        let dir = std::env::temp_dir().join(format!("lendvm-loader-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 4096]).unwrap();
        let err = load(
            ram.memory(),
            ram.regions(),
            &BootSource {
                kernel: &dir,
                cmdline: "",
                initramfs: None,
                acpi_rsdp_addr: None,
            },
        )
        .unwrap_err();
        std::fs::remove_file(&dir).unwrap();
        assert!(matches!(err, LoaderError::Format { .. }), "{err}");
    }
}
