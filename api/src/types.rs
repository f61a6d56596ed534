//! REST request/response types and the remote-device spec parser.
//!
//! Requests use `deny_unknown_fields` so a typo in a client is a 400, not a silently ignored
//! field. Responses are tolerant when read back (clients may be newer than the server) and are
//! described field by field in `api/openapi.yaml`.
//!
//! [`RemoteDeviceSpec`] (`node3:0000:81:00.0`) and [`RemoteDeviceConfig`]
//! (`node3:0000:81:00.0,id=nvme0,mode=trapped`) are shared by the REST API, `lendctl` and the
//! `lendvm --remote-device` command line option.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// Longest accepted device id.
pub const MAX_ID_LEN: usize = 64;
/// Longest accepted node name.
pub const MAX_NODE_LEN: usize = 64;

/// Errors from parsing a BDF, a remote device spec, a device id or a `--remote-device` value.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    #[error("empty device spec: expected NODE:DDDD:BB:DD.F (e.g. node3:0000:81:00.0)")]
    Empty,
    #[error("device spec {0:?} has no node: expected NODE:DDDD:BB:DD.F (e.g. node3:0000:81:00.0)")]
    MissingNode(String),
    #[error("node name {0:?} is invalid: use 1-{MAX_NODE_LEN} characters from [A-Za-z0-9_.-]")]
    BadNode(String),
    #[error("pci address {0:?} is malformed: expected DDDD:BB:DD.F or BB:DD.F (hex)")]
    BdfFormat(String),
    #[error("pci domain {value:?} in {bdf:?} is not a hex number of at most 4 digits")]
    BadDomain { bdf: String, value: String },
    #[error("pci bus {value:?} in {bdf:?} is not a hex number in 00..=ff")]
    BadBus { bdf: String, value: String },
    #[error("pci device {value:?} in {bdf:?} is not a hex number in 00..=1f")]
    BadDevice { bdf: String, value: String },
    #[error("pci function {value:?} in {bdf:?} is not a number in 0..=7")]
    BadFunction { bdf: String, value: String },
    #[error("device id {0:?} is invalid: use 1-{MAX_ID_LEN} characters from [A-Za-z0-9_.-]")]
    BadId(String),
    #[error("device mode {0:?} is invalid: expected direct or trapped")]
    BadMode(String),
    #[error(
        "unknown option {0:?} in remote device {1:?}: expected id=ID, mode=direct|trapped or \
         numa_node=N"
    )]
    UnknownOption(String, String),
    #[error("numa_node {0:?} is not a node number (0, 1, ...)")]
    BadNumaNode(String),
    #[error("option {0:?} given twice in remote device {1:?}")]
    DuplicateOption(String, String),
    #[error("destination_url is empty: expected file:///path/dir or a path")]
    EmptyUrl,
    #[error("{0} is empty: expected unix:/path or tcp:host:port")]
    EmptyMigrationUrl(&'static str),
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.'
}

/// Checks a user-chosen device id (`nvme1`): 1..=64 characters from `[A-Za-z0-9_.-]`.
pub fn validate_device_id(id: &str) -> Result<(), SpecError> {
    if id.is_empty() || id.len() > MAX_ID_LEN || !id.chars().all(is_name_char) {
        return Err(SpecError::BadId(id.to_string()));
    }
    Ok(())
}

/// Checks a fabric node name (`node3`): 1..=64 characters from `[A-Za-z0-9_.-]`.
pub fn validate_node_name(node: &str) -> Result<(), SpecError> {
    if node.is_empty() || node.len() > MAX_NODE_LEN || !node.chars().all(is_name_char) {
        return Err(SpecError::BadNode(node.to_string()));
    }
    Ok(())
}

/// A PCI address `domain:bus:device.function`, shown as `0000:81:00.0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciBdf {
    pub domain: u16,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl PciBdf {
    /// Builds a BDF, checking `device <= 0x1f` and `function <= 7`.
    pub fn new(domain: u16, bus: u8, device: u8, function: u8) -> Result<Self, SpecError> {
        let bdf = format!("{domain:04x}:{bus:02x}:{device:02x}.{function}");
        if device > 0x1f {
            return Err(SpecError::BadDevice {
                bdf,
                value: format!("{device:x}"),
            });
        }
        if function > 7 {
            return Err(SpecError::BadFunction {
                bdf,
                value: function.to_string(),
            });
        }
        Ok(PciBdf {
            domain,
            bus,
            device,
            function,
        })
    }
}

impl fmt::Display for PciBdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

fn hex_field(value: &str, max_digits: usize, max: u32) -> Option<u32> {
    if value.is_empty() || value.len() > max_digits || !value.chars().all(|c| c.is_ascii_hexdigit())
    {
        return None;
    }
    u32::from_str_radix(value, 16).ok().filter(|v| *v <= max)
}

impl FromStr for PciBdf {
    type Err = SpecError;

    /// Parses `DDDD:BB:DD.F` or `BB:DD.F` (domain 0), all fields hex.
    fn from_str(s: &str) -> Result<Self, SpecError> {
        let bdf = s.to_string();
        let (head, function) = s
            .rsplit_once('.')
            .ok_or_else(|| SpecError::BdfFormat(bdf.clone()))?;
        let parts: Vec<&str> = head.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [d, b, dev] => (*d, *b, *dev),
            [b, dev] => ("0000", *b, *dev),
            _ => return Err(SpecError::BdfFormat(bdf)),
        };
        let domain = hex_field(domain, 4, 0xffff).ok_or_else(|| SpecError::BadDomain {
            bdf: bdf.clone(),
            value: domain.to_string(),
        })?;
        let bus = hex_field(bus, 2, 0xff).ok_or_else(|| SpecError::BadBus {
            bdf: bdf.clone(),
            value: bus.to_string(),
        })?;
        let device = hex_field(device, 2, 0x1f).ok_or_else(|| SpecError::BadDevice {
            bdf: bdf.clone(),
            value: device.to_string(),
        })?;
        let function = hex_field(function, 1, 7).ok_or_else(|| SpecError::BadFunction {
            bdf: bdf.clone(),
            value: function.to_string(),
        })?;
        // The ranges were checked above, so the narrowing casts are lossless.
        Ok(PciBdf {
            domain: domain as u16,
            bus: bus as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

impl Serialize for PciBdf {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciBdf {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A device on a lender: `node3:0000:81:00.0` (node name, then the lender-local BDF).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteDeviceSpec {
    pub node: String,
    pub bdf: PciBdf,
}

impl fmt::Display for RemoteDeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.node, self.bdf)
    }
}

impl FromStr for RemoteDeviceSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(SpecError::Empty);
        }
        let (node, bdf) = s
            .split_once(':')
            .ok_or_else(|| SpecError::MissingNode(s.to_string()))?;
        // `81:00.0` alone splits into node "81" and BDF "00.0": report the missing node rather
        // than a confusing BDF error.
        if !bdf.contains(':') {
            return Err(SpecError::MissingNode(s.to_string()));
        }
        validate_node_name(node)?;
        Ok(RemoteDeviceSpec {
            node: node.to_string(),
            bdf: bdf.parse()?,
        })
    }
}

impl Serialize for RemoteDeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RemoteDeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// How the guest reaches the remote device's BARs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RemoteDeviceMode {
    /// BARs are mapped into the guest through fabric windows (no exits on MMIO).
    #[default]
    Direct,
    /// Every BAR access exits to the VMM and is forwarded over the control path.
    Trapped,
}

impl fmt::Display for RemoteDeviceMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RemoteDeviceMode::Direct => "direct",
            RemoteDeviceMode::Trapped => "trapped",
        })
    }
}

impl FromStr for RemoteDeviceMode {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "direct" => Ok(RemoteDeviceMode::Direct),
            "trapped" => Ok(RemoteDeviceMode::Trapped),
            _ => Err(SpecError::BadMode(s.to_string())),
        }
    }
}

/// A remote device as given to `lendvm --remote-device
/// node3:0000:81:00.0[,id=nvme0][,mode=direct|trapped][,numa_node=1]` and as listed in
/// `vm.info`'s `config`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteDeviceConfig {
    pub device: RemoteDeviceSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<RemoteDeviceMode>,
    /// The guest NUMA node the device sits in (`--numa`): it goes on that node's root bus.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
}

impl FromStr for RemoteDeviceConfig {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let mut parts = s.split(',');
        let device: RemoteDeviceSpec = parts.next().unwrap_or_default().parse()?;
        let mut id = None;
        let mut mode = None;
        let mut numa_node = None;
        for opt in parts {
            let (key, value) = opt.split_once('=').unwrap_or((opt, ""));
            match key {
                "id" => {
                    if id.is_some() {
                        return Err(SpecError::DuplicateOption(key.into(), s.into()));
                    }
                    validate_device_id(value)?;
                    id = Some(value.to_string());
                }
                "mode" => {
                    if mode.is_some() {
                        return Err(SpecError::DuplicateOption(key.into(), s.into()));
                    }
                    mode = Some(value.parse()?);
                }
                "numa_node" => {
                    if numa_node.is_some() {
                        return Err(SpecError::DuplicateOption(key.into(), s.into()));
                    }
                    numa_node = Some(
                        value
                            .parse::<u32>()
                            .map_err(|_| SpecError::BadNumaNode(value.into()))?,
                    );
                }
                _ => return Err(SpecError::UnknownOption(opt.into(), s.into())),
            }
        }
        Ok(RemoteDeviceConfig {
            device,
            id,
            mode,
            numa_node,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Requests (bodies of PUT requests).

/// Body of `PUT /api/v1/vm.add-remote-device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmAddRemoteDeviceData {
    /// `node3:0000:81:00.0`.
    pub device: RemoteDeviceSpec,
    /// Device id; the VMM picks one (`_remote<N>`) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// BAR access mode; the VMM default (direct) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<RemoteDeviceMode>,
    /// If the same lender device (or the same id) is in the table as a lost device, clear
    /// that entry first instead of answering 409.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replace_lost: bool,
    /// The guest NUMA node the device sits in (the VM's `--numa` nodes): it goes on that
    /// node's root bus, whose `_PXM` the guest reads. Absent: bus 0 (node 0 with `--numa`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
}

impl VmAddRemoteDeviceData {
    /// Checks what serde cannot: the id's characters and length.
    pub fn validate(&self) -> Result<(), SpecError> {
        if let Some(id) = &self.id {
            validate_device_id(id)?;
        }
        Ok(())
    }
}

/// Body of `PUT /api/v1/vm.remove-device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmRemoveDeviceData {
    pub id: String,
    /// Tear the device down now instead of waiting for the guest to eject it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

impl VmRemoveDeviceData {
    pub fn validate(&self) -> Result<(), SpecError> {
        validate_device_id(&self.id)
    }
}

/// Body of `PUT /api/v1/vm.snapshot` (Cloud Hypervisor's `VmSnapshotConfig`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSnapshotConfig {
    /// Where the snapshot goes: `file:///abs/dir` or a path (a new or empty directory).
    pub destination_url: String,
}

impl VmSnapshotConfig {
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.destination_url.trim().is_empty() {
            return Err(SpecError::EmptyUrl);
        }
        Ok(())
    }
}

/// Body of `PUT /api/v1/vm.send-migration` (Cloud Hypervisor's `VmSendMigrationData`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSendMigrationData {
    /// Where the destination VMM listens: `unix:/path` or `tcp:host:port`.
    pub destination_url: String,
    /// Same-host fast path (Cloud Hypervisor's "local migration", unix urls only): guest
    /// RAM's memfd is passed over SCM_RIGHTS instead of copied.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub local: bool,
}

impl VmSendMigrationData {
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.destination_url.trim().is_empty() {
            return Err(SpecError::EmptyMigrationUrl("destination_url"));
        }
        Ok(())
    }
}

/// Body of `PUT /api/v1/vm.receive-migration` (Cloud Hypervisor's `VmReceiveMigrationData`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmReceiveMigrationData {
    /// Where to listen for the source VMM: `unix:/path` or `tcp:host:port`.
    pub receiver_url: String,
}

impl VmReceiveMigrationData {
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.receiver_url.trim().is_empty() {
            return Err(SpecError::EmptyMigrationUrl("receiver_url"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Responses.

/// Body of `GET /api/v1/vmm.ping`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmmPingResponse {
    pub version: String,
    pub pid: i64,
    #[serde(default)]
    pub features: Vec<String>,
}

/// Body of a successful `PUT /api/v1/vm.add-remote-device` (Cloud Hypervisor's `PciDeviceInfo`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciDeviceInfo {
    pub id: String,
    /// Guest BDF of the new function.
    pub bdf: PciBdf,
}

/// VM lifecycle state, spelled as Cloud Hypervisor does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmState {
    Created,
    Running,
    Paused,
    ShuttingDown,
    Shutdown,
}

impl fmt::Display for VmState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The VM configuration as reported by `vm.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfigInfo {
    pub cpus: u32,
    /// Guest RAM in bytes.
    pub memory_size: u64,
    pub kernel: String,
    #[serde(default)]
    pub cmdline: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<String>,
    /// Devices given on the command line (`--remote-device`).
    #[serde(default)]
    pub remote_devices: Vec<RemoteDeviceConfig>,
    /// The root bus's slots for devices (`--pci-slots`): devices go in slots 1 to this.
    /// Absent from older lendvms (31).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_slots: Option<u32>,
    /// The guest's NUMA nodes (`--numa`), as its ACPI SRAT and SLIT describe them; empty with
    /// one node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa_nodes: Vec<NumaNodeInfo>,
    /// The switches made at launch, one per lender with two or more launch devices on one
    /// root bus: where the guest sees that lender's devices. Empty without.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub switches: Vec<SwitchInfo>,
}

/// A lender's switch as `vm.info` reports it: a PCI-to-PCI bridge with the lender's devices
/// on its secondary bus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchInfo {
    /// The lender whose devices sit behind it.
    pub lender: String,
    /// The bridge's address in the guest.
    pub bridge: String,
    /// Its secondary bus (the devices' bus number).
    pub bus: u8,
    /// Its ports: device numbers 0 to ports - 1 of that bus.
    pub ports: u8,
}

/// A guest NUMA node as `vm.info` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNodeInfo {
    pub id: u32,
    /// Its vCPUs (may be none: a memory-only node).
    pub cpus: Vec<u32>,
    /// Its share of guest RAM, bytes.
    pub memory_size: u64,
    /// Its distance to every node, by node id (10 to itself).
    pub distances: Vec<u32>,
}

/// Lease state of a borrowed device, as seen by the borrower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Lease requested, lender has not granted it yet.
    Pending,
    /// Lease granted; device visible to the guest.
    Active,
    /// Removal requested; waiting for the guest to eject the device.
    Removing,
    /// The lender or the fabric failed; the device is unusable.
    Lost,
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LeaseState::Pending => "pending",
            LeaseState::Active => "active",
            LeaseState::Removing => "removing",
            LeaseState::Lost => "lost",
        })
    }
}

/// The lender-side DMA window that exposes guest RAM to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DmaWindowInfo {
    pub mapped: bool,
    /// Bytes mapped (0 when not mapped).
    pub size: u64,
}

/// Interrupts delivered to the guest for one device, per mechanism.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterruptCounts {
    pub intx: u64,
    pub msi: u64,
    pub msix: u64,
}

impl InterruptCounts {
    pub fn total(&self) -> u64 {
        self.intx.saturating_add(self.msi).saturating_add(self.msix)
    }
}

/// One borrowed device in `vm.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteDeviceInfo {
    pub id: String,
    pub node: String,
    pub lender_bdf: PciBdf,
    pub guest_bdf: PciBdf,
    pub mode: RemoteDeviceMode,
    pub lease_state: LeaseState,
    pub dma_window: DmaWindowInfo,
    pub interrupts: InterruptCounts,
    /// How the guest reached the device; absent when the VMM does not count it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<DeviceAccessCounts>,
}

/// Per-device data-path counters in `vm.info`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAccessCounts {
    /// BAR reads that exited to the VMM.
    pub trapped_bar_reads: u64,
    /// BAR writes that exited to the VMM.
    pub trapped_bar_writes: u64,
    /// Doorbell kicks the VMM signalled itself (store + notify on the exact path).
    pub vmm_doorbell_kicks: u64,
    /// KVM ioeventfds registered for the device now.
    pub ioeventfds: u64,
    /// Doorbell kicks the lender received in total (every path), when it reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lender_doorbell_kicks: Option<u64>,
}

/// The vCPUs' KVM exit statistics, summed, in `vm.info`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvmExitCounts {
    pub exits: u64,
    /// MMIO exits to user space.
    pub mmio_exits: u64,
    pub io_exits: u64,
    pub halt_exits: u64,
}

/// VMM-wide resources held for remote devices (`vm.info`'s optional `counters`), for leak
/// checks: after every device is removed all of them are 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmCounters {
    /// Remote devices in the device table (any lease state).
    pub devices: u64,
    /// Leases held (links to a lender not yet dropped).
    pub leases: u64,
    /// KVM memslots used by devices (guest RAM slots not counted).
    pub memslots: u64,
    /// MSI GSIs allocated (legacy GSIs 0..23 not counted).
    pub gsis: u64,
    /// Irqfds registered by device interrupt groups.
    pub irqfds: u64,
    /// Ioeventfds registered for device BARs.
    pub ioeventfds: u64,
    /// Bytes of guest RAM pinned for device DMA.
    pub pinned_bytes: u64,
    /// Peer-to-peer mappings held (one device's BAR mapped for another's DMA on their
    /// lender). Absent from older VMMs: 0.
    #[serde(default)]
    pub p2p_mappings: u64,
    /// Connections to lenders held (one per lender, shared by its devices). A connection
    /// kept open for reuse after the lender's last device went (`lendvm --lender-idle-ms`)
    /// is not counted. Absent from older VMMs: 0.
    #[serde(default)]
    pub lender_sessions: u64,
    /// Exports of guest RAM as fabric windows (one per lender while any of its devices has
    /// DMA enabled). Absent from older VMMs: 0.
    #[serde(default)]
    pub ram_exports: u64,
}

/// Body of `GET /api/v1/vm.counters`, in Cloud Hypervisor's shape: counter group → counter
/// name → value. Group `vm` holds the VM-wide KVM statistics summed over vCPUs (`exits`,
/// `mmio_exits` = MMIO exits to user space, `io_exits`, `halt_exits`, ...); groups
/// `vm:vcpu0`, `vm:vcpu1`, ... hold each vCPU's own figures of that sum; every other group
/// is a remote device id.
pub type VmCountersReport = BTreeMap<String, BTreeMap<String, u64>>;

/// Body of `GET /api/v1/vm.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    pub config: VmConfigInfo,
    pub state: VmState,
    #[serde(default)]
    pub remote_devices: Vec<RemoteDeviceInfo>,
    /// Resource counters; absent when the VMM does not report them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<VmCounters>,
    /// KVM exit statistics; absent when KVM does not provide them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvm: Option<KvmExitCounts>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bdf(s: &str) -> Result<PciBdf, SpecError> {
        s.parse()
    }

    #[test]
    fn bdf_parses_and_prints() {
        let b = bdf("0000:81:00.0").unwrap();
        assert_eq!(b, PciBdf::new(0, 0x81, 0, 0).unwrap());
        assert_eq!(b.to_string(), "0000:81:00.0");
        assert_eq!(bdf("81:1f.7").unwrap().to_string(), "0000:81:1f.7");
        assert_eq!(bdf("ABCD:FF:1F.7").unwrap().to_string(), "abcd:ff:1f.7");
    }

    #[test]
    fn bdf_ranges_are_checked_and_named() {
        assert!(
            matches!(bdf("0000:81:20.0"), Err(SpecError::BadDevice { value, .. }) if value == "20")
        );
        assert!(
            matches!(bdf("0000:81:00.8"), Err(SpecError::BadFunction { value, .. }) if value == "8")
        );
        assert!(
            matches!(bdf("0000:100:00.0"), Err(SpecError::BadBus { value, .. }) if value == "100")
        );
        assert!(matches!(
            bdf("10000:81:00.0"),
            Err(SpecError::BadDomain { .. })
        ));
        assert!(matches!(bdf("0000:zz:00.0"), Err(SpecError::BadBus { .. })));
        assert!(matches!(bdf("0000:81:00"), Err(SpecError::BdfFormat(_))));
        assert!(matches!(bdf("1:2:3:4.0"), Err(SpecError::BdfFormat(_))));
        assert!(matches!(
            bdf("0000:81:-1.0"),
            Err(SpecError::BadDevice { .. })
        ));
        assert!(matches!(bdf("0000:+1:00.0"), Err(SpecError::BadBus { .. })));
        let msg = bdf("0000:81:20.0").unwrap_err().to_string();
        assert!(msg.contains("pci device \"20\""), "{msg}");
        assert!(PciBdf::new(0, 0, 0x20, 0).is_err());
        assert!(PciBdf::new(0, 0, 0, 8).is_err());
    }

    #[test]
    fn remote_spec_parses() {
        let s: RemoteDeviceSpec = "node3:0000:81:00.0".parse().unwrap();
        assert_eq!(s.node, "node3");
        assert_eq!(s.bdf.bus, 0x81);
        assert_eq!(s.to_string(), "node3:0000:81:00.0");
        let s: RemoteDeviceSpec = "node3:81:00.1".parse().unwrap();
        assert_eq!(s.to_string(), "node3:0000:81:00.1");
    }

    #[test]
    fn remote_spec_errors() {
        assert_eq!("".parse::<RemoteDeviceSpec>(), Err(SpecError::Empty));
        assert!(matches!(
            "81:00.0".parse::<RemoteDeviceSpec>(),
            Err(SpecError::MissingNode(_))
        ));
        assert!(matches!(
            "nodeonly".parse::<RemoteDeviceSpec>(),
            Err(SpecError::MissingNode(_))
        ));
        assert!(matches!(
            "no de:0000:81:00.0".parse::<RemoteDeviceSpec>(),
            Err(SpecError::BadNode(_))
        ));
        assert!(matches!(
            ":0000:81:00.0".parse::<RemoteDeviceSpec>(),
            Err(SpecError::BadNode(_))
        ));
        assert!(matches!(
            "node3:0000:81:00.9".parse::<RemoteDeviceSpec>(),
            Err(SpecError::BadFunction { .. })
        ));
    }

    #[test]
    fn remote_config_parses_options() {
        let c: RemoteDeviceConfig = "node3:0000:81:00.0,id=nvme0,mode=trapped".parse().unwrap();
        assert_eq!(c.device.node, "node3");
        assert_eq!(c.id.as_deref(), Some("nvme0"));
        assert_eq!(c.mode, Some(RemoteDeviceMode::Trapped));
        let c: RemoteDeviceConfig = "node3:0000:81:00.0".parse().unwrap();
        assert_eq!((c.id, c.mode), (None, None));
        assert!(matches!(
            "node3:0000:81:00.0,id=a,id=b".parse::<RemoteDeviceConfig>(),
            Err(SpecError::DuplicateOption(..))
        ));
        assert!(matches!(
            "node3:0000:81:00.0,speed=1".parse::<RemoteDeviceConfig>(),
            Err(SpecError::UnknownOption(..))
        ));
        assert!(matches!(
            "node3:0000:81:00.0,mode=fast".parse::<RemoteDeviceConfig>(),
            Err(SpecError::BadMode(_))
        ));
        assert!(matches!(
            "node3:0000:81:00.0,id=".parse::<RemoteDeviceConfig>(),
            Err(SpecError::BadId(_))
        ));
    }

    #[test]
    fn requests_reject_unknown_fields() {
        let r: Result<VmAddRemoteDeviceData, _> =
            serde_json::from_str(r#"{"device":"node3:0000:81:00.0","idd":"x"}"#);
        assert!(r.unwrap_err().to_string().contains("unknown field `idd`"));
        let r: Result<VmRemoveDeviceData, _> = serde_json::from_str(r#"{"id":"x","forse":true}"#);
        assert!(r.is_err());
        let r: VmRemoveDeviceData = serde_json::from_str(r#"{"id":"x"}"#).unwrap();
        assert!(!r.force);
    }

    #[test]
    fn add_request_reports_bad_bdf() {
        let e = serde_json::from_str::<VmAddRemoteDeviceData>(r#"{"device":"node3:0000:81:20.0"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("pci device \"20\""), "{e}");
    }

    #[test]
    fn ids_are_checked() {
        assert!(validate_device_id("nvme-1_a.b").is_ok());
        assert!(validate_device_id("").is_err());
        assert!(validate_device_id("a/b").is_err());
        assert!(validate_device_id(&"x".repeat(65)).is_err());
    }
}
