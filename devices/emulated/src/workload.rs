//! The NVMe benchmark workload, shared by `benches/nvme.rs` (the controller in-process) and
//! lending's `nvme_lent` bench (local vs lent): the same cases, the same bring-up and the same
//! timed submission loop, so their numbers compare.

use std::time::{Duration, Instant};

use thiserror::Error;

use crate::testing::{DataBuf, DriverError, NvmeDriver};

/// The I/O span the cases address: the first 64 MiB of the namespace, in 512-byte blocks.
pub const SPAN_BLOCKS: u64 = (64 << 20) / 512;

/// The I/O queue the workload uses.
const QID: u16 = 1;

/// One benchmark case.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// Short name, e.g. `randread-4k-qd1`.
    pub name: &'static str,
    /// Writes rather than reads.
    pub write: bool,
    /// Random LBAs rather than sequential.
    pub random: bool,
    /// Bytes per command.
    pub bs: usize,
    /// Commands kept in flight.
    pub qd: usize,
}

const fn case(name: &'static str, write: bool, random: bool, bs: usize, qd: usize) -> Case {
    Case {
        name,
        write,
        random,
        bs,
        qd,
    }
}

/// The cases the NVMe issue asks for: 4 KiB random at QD1/QD32, 128 KiB sequential.
pub const CASES: [Case; 6] = [
    case("randread-4k-qd1", false, true, 4096, 1),
    case("randwrite-4k-qd1", true, true, 4096, 1),
    case("randread-4k-qd32", false, true, 4096, 32),
    case("randwrite-4k-qd32", true, true, 4096, 32),
    case("seqread-128k-qd8", false, false, 128 << 10, 8),
    case("seqwrite-128k-qd8", true, false, 128 << 10, 8),
];

/// Workload errors.
#[derive(Debug, Error)]
pub enum WorkloadError {
    /// The driver failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A command completed with an error status.
    #[error("{case}: command {cid} failed with status {status:#x}")]
    Command {
        /// Case name.
        case: &'static str,
        /// Command id.
        cid: u16,
        /// `SCT << 8 | SC`.
        status: u16,
    },
    /// A completion for a command the workload did not submit.
    #[error("{case}: completion for unknown command {cid}")]
    UnknownCommand {
        /// Case name.
        case: &'static str,
        /// Command id.
        cid: u16,
    },
}

/// Result of one timed run.
#[derive(Debug, Clone, Copy)]
pub struct RunStats {
    /// Commands completed.
    pub ops: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Median command latency.
    pub p50_us: f64,
    /// 99th percentile command latency.
    pub p99_us: f64,
    /// Mean command latency.
    pub avg_us: f64,
}

impl RunStats {
    /// Commands per second.
    pub fn iops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// MiB per second for commands of `bs` bytes.
    pub fn mib_per_s(&self, bs: usize) -> f64 {
        self.iops() * bs as f64 / f64::from(1u32 << 20)
    }
}

/// Same bring-up for every side: one I/O queue pair of 128 entries on vector 1, the span
/// prefilled (so reads hit written blocks), and 32 data buffers of 128 KiB.
pub fn prepare(d: &mut NvmeDriver) -> Result<Vec<DataBuf>, WorkloadError> {
    d.enable(32)?;
    d.set_num_queues(1)?;
    d.create_io_queue_pair(QID, 128, 1)?;
    let fill = d.alloc_data(128 << 10, 0, false)?;
    fill.fill(d.ram(), &vec![0x5a; 128 << 10]);
    for i in 0..(SPAN_BLOCKS / 256) {
        d.rw(QID, true, i * 256, 256, &fill)?;
    }
    d.flush(QID)?;
    (0..32)
        .map(|_| {
            d.alloc_data(128 << 10, 0, false)
                .map_err(WorkloadError::from)
        })
        .collect()
}

/// xorshift64: cheap, deterministic LBAs.
fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Percentile `p` of `lat` (ns, sorted in place) in microseconds.
pub fn percentile_us(lat: &mut [u32], p: f64) -> f64 {
    if lat.is_empty() {
        return 0.0;
    }
    lat.sort_unstable();
    let i = ((lat.len() - 1) as f64 * p).round() as usize;
    lat.get(i).map_or(0.0, |&v| f64::from(v) / 1000.0)
}

/// LBAs for a case: random within the span, or sequential wrapping at its end.
struct LbaGen {
    random: bool,
    nlb: u64,
    slots: u64,
    seed: u64,
    seq: u64,
}

impl LbaGen {
    fn new(c: &Case, seed: u64) -> Self {
        let nlb = (c.bs / 512) as u64;
        let slots = (SPAN_BLOCKS / nlb).max(1);
        let mut seed = seed | 1;
        let seq = (xorshift(&mut seed) % slots) * nlb;
        LbaGen {
            random: c.random,
            nlb,
            slots,
            seed,
            seq,
        }
    }

    fn next(&mut self) -> u64 {
        if self.random {
            (xorshift(&mut self.seed) % self.slots) * self.nlb
        } else {
            let l = self.seq;
            self.seq = (self.seq + self.nlb) % SPAN_BLOCKS;
            l
        }
    }
}

/// One timed run of `c` for `secs` on the queue [`prepare`] created, with the buffers it
/// returned; `lat` is scratch space for per-command latencies (ns).
pub fn run_case(
    d: &mut NvmeDriver,
    bufs: &[DataBuf],
    c: &Case,
    secs: f64,
    seed: u64,
    lat: &mut Vec<u32>,
) -> Result<RunStats, WorkloadError> {
    let nlb = (c.bs / 512) as u32;
    let mut lbas = LbaGen::new(c, seed);
    lat.clear();
    // cid -> (buffer, submit time); cids are < 2^16, a flat table avoids hashing in the loop.
    let mut owner: Vec<Option<(usize, Instant)>> = vec![None; 1 << 16];
    let mut submit = |d: &mut NvmeDriver,
                      owner: &mut [Option<(usize, Instant)>],
                      i: usize,
                      buf: &DataBuf|
     -> Result<(), WorkloadError> {
        let cid = d.push(QID, NvmeDriver::rw_sqe(c.write, lbas.next(), nlb, buf))?;
        if let Some(slot) = owner.get_mut(usize::from(cid)) {
            *slot = Some((i, Instant::now()));
        }
        Ok(())
    };
    for (i, b) in bufs.iter().take(c.qd).enumerate() {
        submit(d, &mut owner, i, b)?;
    }
    d.ring(QID)?;
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut out = Vec::new();
    let mut ops = 0u64;
    let mut total = Duration::ZERO;
    loop {
        out.clear();
        d.wait(QID, &mut out, 1)?;
        let now = Instant::now();
        let stop = now >= end;
        for e in &out {
            if e.code() != 0 {
                return Err(WorkloadError::Command {
                    case: c.name,
                    cid: e.cid,
                    status: e.code(),
                });
            }
            let (i, t) = owner
                .get_mut(usize::from(e.cid))
                .and_then(Option::take)
                .ok_or(WorkloadError::UnknownCommand {
                    case: c.name,
                    cid: e.cid,
                })?;
            ops += 1;
            total += now - t;
            lat.push(u32::try_from((now - t).as_nanos()).unwrap_or(u32::MAX));
            if !stop {
                if let Some(b) = bufs.get(i) {
                    submit(d, &mut owner, i, b)?;
                }
            }
        }
        if stop {
            let n = d.outstanding(QID);
            if n > 0 {
                let mut rest = Vec::new();
                d.wait(QID, &mut rest, n)?;
            }
            break;
        }
        d.ring(QID)?;
    }
    Ok(RunStats {
        ops,
        elapsed: start.elapsed(),
        p50_us: percentile_us(lat, 0.50),
        p99_us: percentile_us(lat, 0.99),
        avg_us: total.as_secs_f64() * 1e6 / ops.max(1) as f64,
    })
}
