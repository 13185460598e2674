//! The staging ring: N slots of S bytes, allocated once at start, memory supplied by the
//! backend. A slot goes out to be filled, comes back filled, is handed to the consumer as a
//! [`SlotGuard`], and returns to the ring only when the guard is released, after the fence of the
//! upload that read it. A slot whose fence has not signalled is never handed out again.

use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};
use crate::io::source::{HostSlot, SlotBuffer};

/// Smallest ring slot nibble accepts: one page, the `O_DIRECT` alignment.
pub const MIN_SLOT_BYTES: u64 = 4096;

/// Signals when the device has finished reading a slot (a copy engine's event, a queue
/// submission's completion). The CPU backend reads slots in place and needs none.
pub trait Fence: Send {
    /// True once the reader is done.
    fn is_signalled(&self) -> bool;
    /// Blocks until signalled.
    fn wait(&self);
}

/// Supplies slot memory: plain host memory here, pinned memory (CUDA) or mapped staging buffers
/// (wgpu) from the backends.
pub trait SlotAllocator {
    /// One slot of `bytes` bytes.
    fn allocate(&self, bytes: usize) -> Result<SlotBuffer>;
}

/// Aligned, pre-touched host memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostAllocator;

impl SlotAllocator for HostAllocator {
    fn allocate(&self, bytes: usize) -> Result<SlotBuffer> {
        Ok(Box::new(HostSlot::try_new(bytes)?))
    }
}

struct Entry {
    buf: SlotBuffer,
    fence: Option<Box<dyn Fence>>,
}

struct State {
    free: Vec<(usize, Entry)>,
}

/// The ring.
pub struct StagingRing {
    shared: Arc<(Mutex<State>, Condvar)>,
    slots: usize,
    slot_bytes: usize,
}

impl std::fmt::Debug for StagingRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StagingRing({} x {} bytes)", self.slots, self.slot_bytes)
    }
}

/// A slot taken from the ring to be filled by a read.
pub struct EmptySlot {
    /// Slot number.
    pub index: usize,
    /// Its memory.
    pub buf: SlotBuffer,
}

impl StagingRing {
    /// Allocates `slots` x `slot_bytes` once.
    pub fn new(slots: usize, slot_bytes: usize, alloc: &dyn SlotAllocator) -> Result<Self> {
        if slots == 0 || slot_bytes == 0 {
            return Err(Error::Invalid(format!(
                "staging ring of {slots} slots x {slot_bytes} bytes: need at least one slot of at least {MIN_SLOT_BYTES} bytes"
            )));
        }
        if (slot_bytes as u64) < MIN_SLOT_BYTES {
            return Err(Error::Invalid(format!(
                "ring slot of {slot_bytes} bytes is smaller than one chunk ({MIN_SLOT_BYTES} bytes)"
            )));
        }
        let total = (slots as u64).saturating_mul(slot_bytes as u64);
        crate::io::machine::check_alloc(
            total,
            &format!("a staging ring of {slots} slots x {slot_bytes} bytes"),
        )?;
        let mut free = Vec::with_capacity(slots);
        for i in (0..slots).rev() {
            free.push((
                i,
                Entry {
                    buf: alloc.allocate(slot_bytes)?,
                    fence: None,
                },
            ));
        }
        Ok(StagingRing {
            shared: Arc::new((Mutex::new(State { free }), Condvar::new())),
            slots,
            slot_bytes,
        })
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Takes a free slot whose previous reader has finished, without blocking on the consumer
    /// (`None` when all slots are out). A free slot whose fence is pending is waited for.
    pub fn try_acquire(&self) -> Option<EmptySlot> {
        let (lock, _) = &*self.shared;
        let (index, entry) = lock.lock().ok()?.free.pop()?;
        if let Some(f) = entry.fence {
            f.wait();
        }
        Some(EmptySlot {
            index,
            buf: entry.buf,
        })
    }

    /// Takes a free slot, blocking until the consumer releases one.
    pub fn acquire(&self) -> EmptySlot {
        loop {
            if let Some(s) = self.try_acquire() {
                return s;
            }
            let (lock, cv) = &*self.shared;
            if let Ok(g) = lock.lock() {
                if g.free.is_empty() {
                    let _unused = cv.wait(g);
                }
            }
        }
    }

    /// Number of slots currently in the ring (not out for filling or consumption).
    pub fn free_slots(&self) -> usize {
        self.shared.0.lock().map(|g| g.free.len()).unwrap_or(0)
    }

    /// Wraps a filled slot for the consumer.
    pub fn filled(&self, slot: EmptySlot, len: usize) -> SlotGuard {
        SlotGuard {
            index: slot.index,
            buf: Some(slot.buf),
            len,
            shared: self.shared.clone(),
        }
    }

    /// Returns an unfilled slot (a failed read).
    pub fn give_back(&self, slot: EmptySlot) {
        put_back(&self.shared, slot.index, slot.buf, None);
    }
}

fn put_back(
    shared: &Arc<(Mutex<State>, Condvar)>,
    index: usize,
    buf: SlotBuffer,
    fence: Option<Box<dyn Fence>>,
) {
    let (lock, cv) = &**shared;
    if let Ok(mut g) = lock.lock() {
        g.free.insert(0, (index, Entry { buf, fence }));
        cv.notify_all();
    }
}

/// A filled slot held by the consumer. Dropping it releases the slot at once, which is right
/// when the host read it in place (the CPU backend); a device upload must instead call
/// [`SlotGuard::release_after`] with the upload's fence, and the ring will not reuse the slot
/// before that fence signals.
#[must_use = "a filled slot is returned to the ring by release_after(fence) or by dropping it"]
pub struct SlotGuard {
    index: usize,
    buf: Option<SlotBuffer>,
    len: usize,
    shared: Arc<(Mutex<State>, Condvar)>,
}

impl std::fmt::Debug for SlotGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotGuard(slot {}, {} bytes)", self.index, self.len)
    }
}

impl SlotGuard {
    /// The filled bytes.
    pub fn bytes(&self) -> &[u8] {
        self.buf
            .as_ref()
            .map(|b| &b.bytes()[..self.len])
            .unwrap_or(&[])
    }

    /// Slot number.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Returns the slot to the ring, to be reused only after `fence` has signalled.
    pub fn release_after(mut self, fence: Box<dyn Fence>) {
        if let Some(buf) = self.buf.take() {
            put_back(&self.shared, self.index, buf, Some(fence));
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            put_back(&self.shared, self.index, buf, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    struct TestFence(Arc<AtomicBool>, Arc<AtomicBool>);
    impl Fence for TestFence {
        fn is_signalled(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
        fn wait(&self) {
            self.1.store(true, Ordering::SeqCst);
            while !self.is_signalled() {
                std::thread::yield_now();
            }
        }
    }

    #[test]
    fn slot_is_reused_only_after_its_fence() {
        let ring = StagingRing::new(1, 4096, &HostAllocator).expect("ring");
        let s = ring.try_acquire().expect("slot");
        assert!(ring.try_acquire().is_none(), "only one slot");
        let guard = ring.filled(s, 10);
        assert_eq!(guard.bytes().len(), 10);
        let signalled = Arc::new(AtomicBool::new(false));
        let waited = Arc::new(AtomicBool::new(false));
        guard.release_after(Box::new(TestFence(signalled.clone(), waited.clone())));
        let s2 = signalled.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            s2.store(true, Ordering::SeqCst);
        });
        let again = ring.try_acquire().expect("slot comes back");
        assert!(waited.load(Ordering::SeqCst), "acquire waited on the fence");
        assert!(
            signalled.load(Ordering::SeqCst),
            "not handed out before the fence signalled"
        );
        assert_eq!(again.index, 0);
        t.join().expect("join");
    }

    #[test]
    fn bad_rings_are_refused() {
        assert!(StagingRing::new(0, 4096, &HostAllocator).is_err());
        assert!(StagingRing::new(2, 0, &HostAllocator).is_err());
        assert!(StagingRing::new(2, 100, &HostAllocator).is_err());
    }
}
