//! The on-disk snapshot format: a directory holding `state.json` (a self-describing JSON
//! document: format name, format version, the lendvm version that wrote it, then the VM's
//! state) and one raw file per guest RAM region (`ram-<n>.bin`, with its size and CRC-32 in
//! the document).
//!
//! KVM's structures (registers, LAPIC page, irqchip, ...) are stored as hex strings of their
//! bytes ([`KvmPod`]): they are the kernel's ABI, fixed in size, and a length check on load
//! turns a truncated or edited value into an error that names the field.
//!
//! A reader first parses only the header and refuses any format name or version it does not
//! know, naming both versions, before it looks at the rest.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use acpi::{GedState, HotplugState};

use crate::legacy::SerialSnapshot;

/// The format name every snapshot document carries.
pub const FORMAT_NAME: &str = "lendvm-snapshot";
/// The format version this lendvm writes and the only one it reads.
pub const FORMAT_VERSION: u32 = 1;
/// The state document inside a snapshot directory.
pub const STATE_FILE: &str = "state.json";
/// Written first and renamed to [`STATE_FILE`] last, so a directory with a `state.json` holds
/// a complete snapshot.
const STATE_TMP: &str = "state.json.partial";

/// Errors of the snapshot format and its locations.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("snapshot url is empty")]
    EmptyUrl,
    #[error(
        "snapshot url '{url}': scheme '{scheme}' is not supported (use file:///path or a path)"
    )]
    Scheme { url: String, scheme: String },
    #[error(
        "snapshot url '{url}': a file url needs an absolute path (file:///path), got host '{host}'"
    )]
    FileHost { url: String, host: String },
    #[error("snapshot destination {0} exists and is not a directory")]
    NotADirectory(PathBuf),
    #[error("snapshot destination {0} is not empty (refusing to overwrite a snapshot)")]
    NotEmpty(PathBuf),
    #[error("cannot {what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a lendvm snapshot document")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{path}: snapshot format '{name}' version {version} (written by lendvm {writer}) is not \
         supported: this lendvm {ours} reads '{FORMAT_NAME}' version {FORMAT_VERSION}"
    )]
    Version {
        path: PathBuf,
        name: String,
        version: u32,
        writer: String,
        ours: &'static str,
    },
    #[error("snapshot field {field}: {why}")]
    Field { field: String, why: String },
    #[error("{file}: {len:#x} bytes, the snapshot says {want:#x} (truncated or wrong file)")]
    RamSize { file: PathBuf, len: u64, want: u64 },
    #[error("{file}: CRC-32 {got:#010x}, the snapshot says {want:#010x} (corrupt)")]
    RamCrc { file: PathBuf, got: u32, want: u32 },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> FormatError {
    let path = path.to_path_buf();
    move |source| FormatError::Io { what, path, source }
}

/// Where a snapshot is written or read: `file:///abs/dir` or a plain path.
pub fn parse_url(url: &str) -> Result<PathBuf, FormatError> {
    let url = url.trim();
    if url.is_empty() {
        return Err(FormatError::EmptyUrl);
    }
    if let Some(rest) = url.strip_prefix("file://") {
        // file:///path has an empty host; file://localhost/path is the same place.
        let (host, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if !(host.is_empty() || host == "localhost") || path.is_empty() {
            return Err(FormatError::FileHost {
                url: url.into(),
                host: host.into(),
            });
        }
        return Ok(PathBuf::from(path));
    }
    if let Some(i) = url.find("://") {
        return Err(FormatError::Scheme {
            url: url.into(),
            scheme: url[..i].into(),
        });
    }
    // `scheme:opaque` forms (unix:..., tcp:...) are not paths either, unless they contain a
    // '/' before the ':' (a relative path with a colon in a name).
    if let Some(i) = url.find(':') {
        let scheme = &url[..i];
        if !scheme.is_empty()
            && !scheme.contains('/')
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        {
            return Err(FormatError::Scheme {
                url: url.into(),
                scheme: scheme.into(),
            });
        }
    }
    Ok(PathBuf::from(url))
}

/// Makes `dir` ready to receive a snapshot: creates it if missing (its parent must exist),
/// refuses a non-directory or a non-empty directory, and proves it is writable.
pub fn prepare_destination(dir: &Path) -> Result<(), FormatError> {
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => return Err(FormatError::NotADirectory(dir.into())),
        Ok(_) => {
            let mut entries = std::fs::read_dir(dir).map_err(io("read directory", dir))?;
            if entries.next().is_some() {
                return Err(FormatError::NotEmpty(dir.into()));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir(dir).map_err(io("create directory", dir))?;
        }
        Err(e) => return Err(io("inspect", dir)(e)),
    }
    let probe = dir.join(STATE_TMP);
    File::create(&probe).map_err(io("write into", dir))?;
    Ok(())
}

/// Removes what a failed snapshot left in `dir` (only the files this format writes).
pub fn remove_partial(dir: &Path, ram_files: usize) {
    let mut names = vec![STATE_TMP.to_string(), STATE_FILE.to_string()];
    names.extend((0..ram_files).map(ram_file_name));
    for n in names {
        let _ = std::fs::remove_file(dir.join(n));
    }
}

/// The file of RAM region `i`.
pub fn ram_file_name(i: usize) -> String {
    format!("ram-{i}.bin")
}

/// What every document starts with; read alone first to check the version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u32,
    pub lendvm_version: String,
}

impl Header {
    pub fn current() -> Self {
        Self {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            lendvm_version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// The VM's shape, enough to rebuild it before the state goes back in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineConfig {
    pub cpus: u8,
    pub memory_size: u64,
    /// Informational: the kernel is in guest RAM, the file is not read on restore.
    pub kernel: String,
    pub cmdline: String,
    /// Where the guest's console went (`--serial`'s form): a migrated VM's console goes
    /// there on the destination too, unless the destination's own `--serial` says otherwise.
    /// Absent in documents of older lendvms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// The guest's CPU model (`--cpu-model`'s name): a restored or migrated VM keeps the
    /// CPUID it booted with. Absent in documents of older lendvms (they had `host`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    /// The 64-bit PCI window's size (`--pci-mmio64-size`): the BARs keep their addresses,
    /// so the window moves with the VM. Absent in documents of older lendvms (64 GiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_mmio64_size: Option<u64>,
    /// The guest's NUMA nodes (`--numa`): its ACPI tables, and what a restored or migrated
    /// VM's are rebuilt from. Absent with one node and in documents of older lendvms.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa: Vec<crate::numa::NumaNodeConfig>,
    /// The root bus's slots for devices (`--pci-slots`): the guest's ACPI tables describe
    /// them, and a restored or migrated VM's bus keeps them. Absent in documents of older
    /// lendvms (31).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_slots: Option<u8>,
    /// The switches made at launch, one per lender with two or more launch devices: the
    /// guest's bus numbers and ACPI tables depend on them, so a restored or migrated VM
    /// rebuilds them. Absent without switches and in documents of older lendvms.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub switches: Vec<crate::device_manager::LenderSwitch>,
}

impl MachineConfig {
    /// The root bus's slots for devices: the document's, or 31 for an older lendvm's.
    pub fn pci_slots(&self) -> u8 {
        self.pci_slots.unwrap_or(pci::root::MAX_DEVICE_SLOTS)
    }
}

/// One guest RAM region and its file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamFile {
    pub gpa: u64,
    pub size: u64,
    pub file: String,
    pub crc32: u32,
}

/// One MSR (index, value).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsrValue {
    pub index: u32,
    pub data: u64,
}

/// One vCPU as KVM reports it (hex strings: see [`KvmPod`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub regs: String,
    pub sregs: String,
    pub fpu: String,
    /// Absent when KVM has no XSAVE (PVM hosts).
    pub xsave: Option<String>,
    /// Absent when KVM has no XCRs (PVM hosts).
    pub xcrs: Option<String>,
    pub lapic: String,
    pub msrs: Vec<MsrValue>,
    pub vcpu_events: String,
    pub mp_state: String,
}

/// VM-wide KVM state: the in-kernel irqchip (PIC master, PIC slave, IOAPIC), PIT and clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvmVmState {
    pub pic_master: String,
    pub pic_slave: String,
    pub ioapic: String,
    pub pit: String,
    pub clock: String,
}

/// VMM-side devices.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStates {
    pub serial: Option<SerialSnapshot>,
    pub ged: GedState,
    pub hotplug: HotplugState,
    /// Lent devices: lease identity and guest-visible PCI state, re-borrowed on restore.
    #[serde(default)]
    pub lent: Vec<super::devices::LentDevice>,
}

/// The whole document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSnapshot {
    #[serde(flatten)]
    pub header: Header,
    pub config: MachineConfig,
    pub memory: Vec<RamFile>,
    pub vm: KvmVmState,
    pub vcpus: Vec<VcpuState>,
    pub devices: DeviceStates,
}

/// Writes the document as `dir/state.json` (through a temporary name, so the document appears
/// only once everything else is on disk).
pub fn write_document(dir: &Path, snap: &VmSnapshot) -> Result<(), FormatError> {
    let tmp = dir.join(STATE_TMP);
    let text = serde_json::to_vec_pretty(snap).map_err(|source| FormatError::Parse {
        path: tmp.clone(),
        source,
    })?;
    let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
    f.write_all(&text).map_err(io("write", &tmp))?;
    f.sync_all().map_err(io("sync", &tmp))?;
    let dst = dir.join(STATE_FILE);
    std::fs::rename(&tmp, &dst).map_err(io("rename into place", &dst))?;
    Ok(())
}

/// Reads `dir/state.json`: the header first (format name and version), then the rest.
pub fn read_document(dir: &Path) -> Result<VmSnapshot, FormatError> {
    let path = dir.join(STATE_FILE);
    let mut text = Vec::new();
    File::open(&path)
        .and_then(|mut f| f.read_to_end(&mut text))
        .map_err(io("read", &path))?;
    let header: Header = serde_json::from_slice(&text).map_err(|source| FormatError::Parse {
        path: path.clone(),
        source,
    })?;
    if header.format != FORMAT_NAME || header.version != FORMAT_VERSION {
        return Err(FormatError::Version {
            path,
            name: header.format,
            version: header.version,
            writer: header.lendvm_version,
            ours: env!("CARGO_PKG_VERSION"),
        });
    }
    serde_json::from_slice(&text).map_err(|source| FormatError::Parse { path, source })
}

/// Copies `len` bytes from `src` (at its current position) into a new file `dir/name`,
/// returning the CRC-32 of what was written.
pub fn write_ram_file(
    dir: &Path,
    name: &str,
    src: &mut impl Read,
    len: u64,
) -> Result<u32, FormatError> {
    let path = dir.join(name);
    let mut out = File::create(&path).map_err(io("create", &path))?;
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        src.read_exact(&mut buf[..n])
            .map_err(io("read guest RAM for", &path))?;
        crc.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io("write", &path))?;
        left -= n as u64;
    }
    out.sync_all().map_err(io("sync", &path))?;
    Ok(crc.finalize())
}

/// Checks `dir/<ram.file>` (size and CRC-32) and copies it into `dst`.
pub fn read_ram_file(dir: &Path, ram: &RamFile, dst: &mut impl Write) -> Result<(), FormatError> {
    if ram.file.contains('/') || ram.file.starts_with('.') {
        return Err(FormatError::Field {
            field: "memory[].file".into(),
            why: format!("'{}' is not a file name inside the snapshot", ram.file),
        });
    }
    let path = dir.join(&ram.file);
    let mut f = File::open(&path).map_err(io("open", &path))?;
    let len = f.metadata().map_err(io("inspect", &path))?.len();
    if len != ram.size {
        return Err(FormatError::RamSize {
            file: path,
            len,
            want: ram.size,
        });
    }
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.read_exact(&mut buf[..n]).map_err(io("read", &path))?;
        crc.update(&buf[..n]);
        dst.write_all(&buf[..n])
            .map_err(io("copy into guest RAM from", &path))?;
        left -= n as u64;
    }
    let got = crc.finalize();
    if got != ram.crc32 {
        return Err(FormatError::RamCrc {
            file: path,
            got,
            want: ram.crc32,
        });
    }
    Ok(())
}

/// KVM ABI structures stored as the hex string of their bytes.
///
/// # Safety
///
/// Implement only for plain-old-data `#[repr(C)]` types of integers and arrays of integers
/// (bindgen's KVM structures) for which every bit pattern is a valid value, and which have no
/// padding bytes that could be uninitialised.
pub unsafe trait KvmPod: Copy + Default {
    const NAME: &'static str;
}

macro_rules! kvm_pod {
    ($($t:ident),*) => {$(
        // SAFETY: bindgen-generated KVM ABI structs: repr(C), integer fields and integer
        // arrays only, so any bit pattern is valid; the kernel ABI spells out its padding as
        // fields (kvm-bindings' `serde` feature derives zerocopy's `IntoBytes` for exactly
        // these types, which proves they have no implicit padding).
        unsafe impl KvmPod for kvm_bindings::$t {
            const NAME: &'static str = stringify!($t);
        }
    )*};
}

kvm_pod!(
    kvm_regs,
    kvm_sregs,
    kvm_fpu,
    kvm_xcrs,
    kvm_lapic_state,
    kvm_vcpu_events,
    kvm_mp_state,
    kvm_irqchip,
    kvm_pit_state2,
    kvm_clock_data
);

/// `v`'s bytes as lower-case hex.
pub fn to_hex<T: KvmPod>(v: &T) -> String {
    // SAFETY: `T: KvmPod` is plain old data with initialised bytes; the slice covers exactly
    // `v` and lives no longer than the borrow.
    let bytes = unsafe {
        std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>())
    };
    bytes_to_hex(bytes)
}

/// 32-bit words (KVM's XSAVE area) as the hex of their little-endian bytes.
pub fn words_to_hex(words: &[u32]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes_to_hex(&bytes)
}

/// The inverse of [`words_to_hex`] into exactly `out.len()` words.
pub fn hex_to_words(field: &str, s: &str, out: &mut [u32]) -> Result<(), FormatError> {
    let mut bytes = vec![0u8; out.len() * 4];
    hex_into(field, "xsave area", s, &mut bytes)?;
    for (w, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

fn bytes_to_hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        s.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    s
}

/// Parses the hex string of field `field` into a `T`, which must be exactly `size_of::<T>()`
/// bytes long.
pub fn from_hex<T: KvmPod>(field: &str, s: &str) -> Result<T, FormatError> {
    let want = std::mem::size_of::<T>();
    let mut v = T::default();
    // SAFETY: as in `to_hex`; every bit pattern is a valid `T`, and the slice covers exactly
    // `v`, which is not otherwise borrowed while it lives.
    let bytes = unsafe { std::slice::from_raw_parts_mut((&mut v as *mut T).cast::<u8>(), want) };
    hex_into(field, T::NAME, s, bytes)?;
    Ok(v)
}

/// Decodes `s` into exactly `bytes.len()` bytes.
fn hex_into(field: &str, what: &str, s: &str, bytes: &mut [u8]) -> Result<(), FormatError> {
    let want = bytes.len();
    let bad = |why: String| FormatError::Field {
        field: field.into(),
        why,
    };
    if s.len() != want * 2 {
        return Err(bad(format!(
            "{what} is {want} bytes, the snapshot has {} hex digits",
            s.len()
        )));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    for (i, pair) in s.as_bytes().chunks(2).enumerate() {
        match (digit(pair[0]), digit(pair[1])) {
            (Some(h), Some(l)) => bytes[i] = h << 4 | l,
            _ => {
                return Err(bad(format!(
                    "not hex at digit {} ('{}')",
                    i * 2,
                    String::from_utf8_lossy(pair)
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> VmSnapshot {
        let regs = kvm_bindings::kvm_regs {
            rip: 0x1234_5678,
            rax: 7,
            ..Default::default()
        };
        VmSnapshot {
            header: Header::current(),
            config: MachineConfig {
                cpus: 2,
                memory_size: 64 << 20,
                kernel: "/k".into(),
                cmdline: "tests=none".into(),
                serial: Some("file=/tmp/console.log".into()),
                cpu_model: Some("qemu64".into()),
                pci_mmio64_size: Some(256 << 30),
                numa: vec![crate::numa::NumaNodeConfig {
                    id: 0,
                    cpus: vec![0, 1],
                    memory: 64 << 20,
                    distances: Vec::new(),
                }],
                pci_slots: Some(4),
                switches: vec![crate::device_manager::LenderSwitch {
                    lender: "node-a".into(),
                    root: 0,
                    ports: 4,
                }],
            },
            memory: vec![RamFile {
                gpa: 0,
                size: 8192,
                file: ram_file_name(0),
                crc32: 0,
            }],
            vm: KvmVmState {
                pic_master: to_hex(&kvm_bindings::kvm_irqchip::default()),
                pic_slave: to_hex(&kvm_bindings::kvm_irqchip::default()),
                ioapic: to_hex(&kvm_bindings::kvm_irqchip::default()),
                pit: to_hex(&kvm_bindings::kvm_pit_state2::default()),
                clock: to_hex(&kvm_bindings::kvm_clock_data::default()),
            },
            vcpus: vec![VcpuState {
                id: 0,
                regs: to_hex(&regs),
                sregs: to_hex(&kvm_bindings::kvm_sregs::default()),
                fpu: to_hex(&kvm_bindings::kvm_fpu::default()),
                xsave: None,
                xcrs: None,
                lapic: to_hex(&kvm_bindings::kvm_lapic_state::default()),
                msrs: vec![MsrValue {
                    index: 0x10,
                    data: 99,
                }],
                vcpu_events: to_hex(&kvm_bindings::kvm_vcpu_events::default()),
                mp_state: to_hex(&kvm_bindings::kvm_mp_state::default()),
            }],
            devices: DeviceStates::default(),
        }
    }

    #[test]
    fn document_round_trips_and_carries_its_header() {
        let dir = tempfile::tempdir().unwrap();
        let snap = sample();
        write_document(dir.path(), &snap).unwrap();
        let text = std::fs::read_to_string(dir.path().join(STATE_FILE)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["format"], FORMAT_NAME);
        assert_eq!(v["version"], FORMAT_VERSION);
        assert_eq!(v["lendvm_version"], env!("CARGO_PKG_VERSION"));
        let back = read_document(dir.path()).unwrap();
        assert_eq!(back, snap);
        let regs: kvm_bindings::kvm_regs = from_hex("regs", &back.vcpus[0].regs).unwrap();
        assert_eq!(regs.rip, 0x1234_5678);
        assert_eq!(regs.rax, 7);
        assert!(!dir.path().join(STATE_TMP).exists());
    }

    #[test]
    fn unknown_version_or_format_is_refused_naming_both_versions() {
        let dir = tempfile::tempdir().unwrap();
        let mut snap = sample();
        snap.header.version = FORMAT_VERSION + 1;
        snap.header.lendvm_version = "9.9.9".into();
        write_document(dir.path(), &snap).unwrap();
        let e = read_document(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(&format!("version {}", FORMAT_VERSION + 1))
                && e.contains(&format!("version {FORMAT_VERSION}"))
                && e.contains("9.9.9"),
            "{e}"
        );
        // A future version may have changed everything else: the header alone decides.
        std::fs::write(
            dir.path().join(STATE_FILE),
            r#"{"format":"lendvm-snapshot","version":2,"lendvm_version":"2.0","new":1}"#,
        )
        .unwrap();
        let e = read_document(dir.path()).unwrap_err().to_string();
        assert!(e.contains("version 2") && e.contains("version 1"), "{e}");
        std::fs::write(
            dir.path().join(STATE_FILE),
            r#"{"format":"other-vmm","version":1,"lendvm_version":"1"}"#,
        )
        .unwrap();
        let e = read_document(dir.path()).unwrap_err().to_string();
        assert!(e.contains("'other-vmm'"), "{e}");
    }

    #[test]
    fn corrupt_documents_and_fields_give_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(STATE_FILE), "{\"format\": \"lendvm-snap").unwrap();
        let e = read_document(dir.path()).unwrap_err();
        assert!(matches!(e, FormatError::Parse { .. }), "{e}");
        let e = read_document(&dir.path().join("nothing")).unwrap_err();
        assert!(e.to_string().contains("cannot read"), "{e}");
        let e = from_hex::<kvm_bindings::kvm_regs>("vcpus[0].regs", "00ff").unwrap_err();
        assert!(
            e.to_string().contains("vcpus[0].regs") && e.to_string().contains("kvm_regs"),
            "{e}"
        );
        let mut s = to_hex(&kvm_bindings::kvm_regs::default());
        s.replace_range(4..6, "zz");
        let e = from_hex::<kvm_bindings::kvm_regs>("regs", &s).unwrap_err();
        assert!(e.to_string().contains("not hex at digit 4"), "{e}");
    }

    #[test]
    fn ram_files_are_checked_for_size_and_crc() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let crc = write_ram_file(dir.path(), "ram-0.bin", &mut &data[..], 10_000).unwrap();
        let ram = RamFile {
            gpa: 0,
            size: 10_000,
            file: "ram-0.bin".into(),
            crc32: crc,
        };
        let mut out = Vec::new();
        read_ram_file(dir.path(), &ram, &mut out).unwrap();
        assert_eq!(out, data);
        let e = read_ram_file(
            dir.path(),
            &RamFile {
                crc32: crc ^ 1,
                ..ram.clone()
            },
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(matches!(e, FormatError::RamCrc { .. }), "{e}");
        std::fs::write(dir.path().join("ram-0.bin"), &data[..5000]).unwrap();
        let e = read_ram_file(dir.path(), &ram, &mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let e = read_ram_file(
            dir.path(),
            &RamFile {
                file: "../x".into(),
                ..ram
            },
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a file name"), "{e}");
    }

    #[test]
    fn urls_take_file_and_paths_and_refuse_other_schemes() {
        assert_eq!(parse_url("file:///tmp/s").unwrap(), PathBuf::from("/tmp/s"));
        assert_eq!(
            parse_url("file://localhost/tmp/s").unwrap(),
            PathBuf::from("/tmp/s")
        );
        assert_eq!(parse_url("/tmp/s").unwrap(), PathBuf::from("/tmp/s"));
        assert_eq!(parse_url("snaps/a").unwrap(), PathBuf::from("snaps/a"));
        assert_eq!(parse_url("./a:b").unwrap(), PathBuf::from("./a:b"));
        for bad in [
            "tcp://host:1234",
            "http://x/y",
            "unix:/tmp/sock",
            "s3://b/k",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert!(matches!(e, FormatError::Scheme { .. }), "{bad}: {e}");
            assert!(e.to_string().contains(bad), "{e}");
        }
        assert!(matches!(
            parse_url("file://otherhost/x").unwrap_err(),
            FormatError::FileHost { .. }
        ));
        assert!(matches!(
            parse_url("  ").unwrap_err(),
            FormatError::EmptyUrl
        ));
    }

    #[test]
    fn destinations_must_be_new_or_empty_directories_we_can_write() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("snap");
        prepare_destination(&fresh).unwrap();
        assert!(fresh.is_dir());
        // The probe file makes it non-empty now: a second snapshot there is refused.
        let e = prepare_destination(&fresh).unwrap_err();
        assert!(matches!(e, FormatError::NotEmpty(_)), "{e}");
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        assert!(matches!(
            prepare_destination(&file).unwrap_err(),
            FormatError::NotADirectory(_)
        ));
        let e = prepare_destination(&dir.path().join("no/such/parent")).unwrap_err();
        assert!(e.to_string().contains("cannot create directory"), "{e}");
    }

    #[test]
    fn a_failed_snapshot_leaves_only_what_was_there() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("s");
        prepare_destination(&d).unwrap();
        write_ram_file(&d, &ram_file_name(0), &mut &[1u8; 64][..], 64).unwrap();
        write_ram_file(&d, &ram_file_name(1), &mut &[2u8; 64][..], 64).unwrap();
        remove_partial(&d, 2);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        // A second attempt into the same place is accepted.
        prepare_destination(&d).unwrap();
    }
}
