//! Window-read replies received straight into the reader's buffer.
//!
//! A tcp window read used to land in a fresh, zeroed payload buffer that the caller then
//! copied into its own: two passes over every byte after decryption (and page faults on
//! each new 1 MiB buffer). A [`ReplySink`] lets the link's reader thread decrypt a reply's
//! payload into the caller's buffer instead. The caller keeps the buffer borrowed until every
//! sink it armed is disarmed ([`SinkSet`]'s `Drop`), and disarming waits for a fill in
//! progress, so the reader never writes to memory the caller has got back.

use super::*;

/// The destination of one window-read reply.
pub(super) struct ReplySink {
    dst: Mutex<Option<RawDst>>,
    filled: AtomicBool,
}

struct RawDst {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is only dereferenced under the sink's mutex, by the reader thread, while
// the caller that armed it guarantees the range stays valid and untouched (`ReplySink::new`).
unsafe impl Send for RawDst {}

impl ReplySink {
    /// A sink for `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be valid for writes and neither read nor written by anyone else
    /// until [`Self::disarm`] has returned.
    pub(super) unsafe fn new(ptr: *mut u8, len: usize) -> Arc<ReplySink> {
        Arc::new(ReplySink {
            dst: Mutex::new(Some(RawDst { ptr, len })),
            filled: AtomicBool::new(false),
        })
    }

    /// Reader side: when the sink is still armed and expects exactly `len` bytes, runs `read`
    /// on the destination and returns its result; `None` when the payload must be read the
    /// usual way (the caller gave up, or the peer sent another length, which the caller then
    /// reports). The sink is disarmed after one fill, whatever its result.
    pub(super) fn fill(
        &self,
        len: usize,
        read: impl FnOnce(&mut [u8]) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        let mut guard = lock(&self.dst);
        let d = guard.as_ref().filter(|d| d.len == len)?;
        // SAFETY: armed, so the range is valid and the caller does not touch it until disarm,
        // which needs this lock (see `new`).
        let dst = unsafe { std::slice::from_raw_parts_mut(d.ptr, d.len) };
        let r = read(dst);
        *guard = None;
        if r.is_ok() {
            self.filled.store(true, Ordering::Release);
        }
        Some(r)
    }

    /// Caller side: the reader will not touch the destination again (waits for a fill in
    /// progress). True when a fill completed, so the bytes are in place.
    pub(super) fn disarm(&self) -> bool {
        lock(&self.dst).take();
        self.filled.load(Ordering::Acquire)
    }
}

/// The sinks one transfer armed; dropping it disarms them all, so an early return (an error,
/// a timeout) hands the buffer back only once no reader can write to it.
#[derive(Default)]
pub(super) struct SinkSet(Vec<Arc<ReplySink>>);

impl SinkSet {
    pub(super) fn push(&mut self, s: Arc<ReplySink>) {
        self.0.push(s);
    }
}

impl Drop for SinkSet {
    fn drop(&mut self) {
        for s in &self.0 {
            s.disarm();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sink_fills_once_and_only_with_its_length() {
        let mut buf = [0u8; 8];
        // SAFETY: buf outlives the sink's use and is not touched until disarm below.
        let s = unsafe { ReplySink::new(buf.as_mut_ptr(), buf.len()) };
        assert!(s.fill(7, |_| unreachable!()).is_none(), "wrong length");
        let r = s.fill(8, |d| {
            d.copy_from_slice(b"12345678");
            Ok(())
        });
        assert!(matches!(r, Some(Ok(()))));
        assert!(s.fill(8, |_| unreachable!()).is_none(), "filled once");
        assert!(s.disarm());
        assert_eq!(&buf, b"12345678");
    }

    #[test]
    fn a_disarmed_sink_is_never_written_and_a_failed_fill_is_not_filled() {
        let mut buf = [0u8; 4];
        // SAFETY: as above.
        let s = unsafe { ReplySink::new(buf.as_mut_ptr(), buf.len()) };
        assert!(!s.disarm());
        assert!(s.fill(4, |_| unreachable!()).is_none());
        // SAFETY: as above.
        let t = unsafe { ReplySink::new(buf.as_mut_ptr(), buf.len()) };
        let r = t.fill(4, |d| {
            d[0] = 9;
            Err(io::Error::from(io::ErrorKind::UnexpectedEof))
        });
        assert!(matches!(r, Some(Err(_))));
        assert!(!t.disarm(), "a short read is not a fill");
        assert_eq!(buf[0], 9);
    }
}
