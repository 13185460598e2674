//! The host tier: a [`ByteSource`] in front of the model's source that keeps the bytes of the
//! chunks it is told to keep after their first read, in one allocation made when the stream
//! starts ([`TierStore`], from the backend's slot allocator: pinned host memory for CUDA, so that
//! uploads from it are DMA), and answers later reads of them without asking the source again:
//! such a completion carries the bytes as [`HeldBytes`], explicitly, and the consumer uploads
//! them from there, without a copy into the ring slot and without a lookup or a lock. Reads of
//! other chunks go to the source as before.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::io::source::{
    ByteSource, HeldBytes, HeldMemory, ReadCompletion, ReadRequest, SlotBuffer, SourceFile,
};
use crate::stream::ring::SlotAllocator;

/// A chunk: file, offset, length.
pub type ChunkKey = (usize, u64, usize);

/// A kept chunk's state: its bytes not there yet, being written (by one fill), there.
const EMPTY: u8 = 0;
const FILLING: u8 = 1;
const FULL: u8 = 2;

/// Where each kept chunk starts in the store: a multiple of this many bytes.
const CHUNK_ALIGN: usize = 64;

/// The host tier's memory: every kept chunk at its own place in one buffer, allocated once when
/// the stream starts (so that it counts in RSS from then on, as the plan predicts). A chunk's
/// bytes are written once, by its first read, and only read after that: [`HeldBytes`] over them
/// stay valid while any handle to the store lives.
pub struct TierStore {
    /// Owns the memory `base` points into (`None` when nothing is kept).
    _buf: Option<SlotBuffer>,
    base: *mut u8,
    /// Per kept chunk: its offset in the buffer and its state (`EMPTY`, `FILLING`, `FULL`).
    at: HashMap<ChunkKey, (usize, AtomicU8)>,
    bytes: u64,
}

// SAFETY: `base` points into `_buf`, which the store owns and which is `Send`. Bytes are written
// only by `fill`, into a chunk whose state it moved from EMPTY to FILLING (so by one writer,
// before any reader: readers see a chunk only once FULL, published with Release/Acquire), and
// never written again; the map itself is not changed after `new`.
unsafe impl Send for TierStore {}
unsafe impl Sync for TierStore {}

impl std::fmt::Debug for TierStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierStore")
            .field("chunks", &self.at.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl TierStore {
    /// Room for the chunks `keep`, from `alloc` (checked against the memory available first).
    pub fn new(
        keep: impl IntoIterator<Item = ChunkKey>,
        alloc: &dyn SlotAllocator,
    ) -> Result<Self> {
        let mut keys: Vec<ChunkKey> = keep.into_iter().collect();
        keys.sort_unstable();
        keys.dedup();
        let mut at = HashMap::with_capacity(keys.len());
        let mut total = 0usize;
        for k in keys {
            at.insert(k, (total, AtomicU8::new(EMPTY)));
            total = total
                .checked_add(k.2.div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN)
                .ok_or_else(|| Error::Invalid("the host tier is larger than memory".into()))?;
        }
        if total == 0 {
            // Nothing to hold (or only empty chunks): a well-aligned dangling pointer, which
            // empty slices and copies of no bytes accept.
            return Ok(TierStore {
                _buf: None,
                base: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                at,
                bytes: 0,
            });
        }
        crate::io::machine::check_alloc(total as u64, "the host tier")?;
        let mut buf = alloc.allocate(total)?;
        let mem = buf.bytes_mut();
        if mem.len() < total {
            return Err(Error::Invalid(format!(
                "the host tier asked for {total} bytes and got {}",
                mem.len()
            )));
        }
        let base = mem.as_mut_ptr();
        Ok(TierStore {
            _buf: Some(buf),
            base,
            at,
            bytes: total as u64,
        })
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether `key` is kept here.
    pub fn keeps(&self, key: &ChunkKey) -> bool {
        self.at.contains_key(key)
    }

    /// Bytes held now (the kept chunks read so far).
    pub fn held_bytes(&self) -> u64 {
        self.at
            .iter()
            .filter(|(_, (_, state))| state.load(Ordering::Acquire) == FULL)
            .map(|(k, _)| k.2 as u64)
            .sum()
    }

    /// Where `key`'s bytes are, once its first read has arrived. They do not change while the
    /// store lives (a chunk is written once).
    fn held_at(&self, key: &ChunkKey) -> Option<usize> {
        self.at
            .get(key)
            .filter(|(_, state)| state.load(Ordering::Acquire) == FULL)
            .map(|(off, _)| *off)
    }

    /// The bytes of `key` as held bytes, once its first read has arrived.
    pub fn get(self: &Arc<Self>, key: &ChunkKey) -> Option<HeldBytes> {
        let off = self.held_at(key)?;
        Some(HeldBytes::new(self.clone(), off, key.2))
    }

    /// Keeps `bytes` as the chunk `key` (its first read); nothing when `key` is not kept here
    /// or already held (or being written).
    fn fill(&self, key: ChunkKey, bytes: &[u8]) {
        let Some((off, state)) = self.at.get(&key) else {
            return;
        };
        if bytes.len() < key.2
            || state
                .compare_exchange(EMPTY, FILLING, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        // SAFETY: the chunk's place lies inside the buffer; this call alone moved it from EMPTY
        // to FILLING, so nobody else writes it and no reader sees it before FULL; `bytes` is
        // another allocation (a ring slot).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(*off), key.2) };
        state.store(FULL, Ordering::Release);
    }
}

impl HeldMemory for TierStore {
    fn held(&self, offset: usize, len: usize) -> &[u8] {
        // SAFETY: `HeldBytes` over the store are made only by `get`, for a FULL chunk at
        // `offset`, `len` long, inside the buffer; its bytes never change again.
        unsafe { std::slice::from_raw_parts(self.base.add(offset), len) }
    }
}

/// A [`TierStore`] shared by the tier's source (which fills it) and the held bytes it hands out.
pub type SharedStore = Arc<TierStore>;

/// The caching source. A completion for a kept chunk that is already held carries its bytes
/// as [`HeldBytes`] and its slot unfilled; the store holds them from the chunk's first read on
/// (before that read's completion is handed out).
pub struct HostTierSource {
    inner: Box<dyn ByteSource>,
    store: SharedStore,
    /// Reads sent to the source, by tag: the chunk and whether to keep its bytes.
    pending: HashMap<u64, (ChunkKey, bool)>,
    /// Later reads of a kept chunk whose first read is still in flight (a ring deeper than one
    /// step): answered from the store when it arrives, never read twice.
    waiting: HashMap<ChunkKey, Vec<ReadRequest>>,
    ready: VecDeque<ReadCompletion>,
}

impl std::fmt::Debug for HostTierSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTierSource")
            .field("store", &self.store)
            .finish()
    }
}

impl HostTierSource {
    /// In front of `inner`, keeping the chunks `store` has room for.
    pub fn new(inner: Box<dyn ByteSource>, store: SharedStore) -> Self {
        HostTierSource {
            inner,
            store,
            pending: HashMap::new(),
            waiting: HashMap::new(),
            ready: VecDeque::new(),
        }
    }

    /// A completion from the source: its bytes kept when asked, and the reads that waited for
    /// it answered (from the store; with its error if it failed).
    fn arrived(&mut self, c: ReadCompletion) -> ReadCompletion {
        if let Some((key, keep)) = self.pending.remove(&c.tag) {
            if keep && c.result.is_ok() {
                self.store.fill(key, c.slot.bytes());
            }
            for req in self.waiting.remove(&key).unwrap_or_default() {
                let held = c.result.as_ref().ok().and_then(|_| self.store.get(&key));
                match (&c.result, held) {
                    (Ok(()), Some(held)) => self.serve(req, held),
                    (r, _) => self.ready.push_back(ReadCompletion {
                        tag: req.tag,
                        slot: req.slot,
                        result: Err(Error::Invalid(format!(
                            "{}: the read this chunk waited for failed: {}",
                            req.what,
                            r.as_ref()
                                .err()
                                .map_or("it was not kept".into(), |e| e.to_string())
                        ))),
                        elapsed: Duration::ZERO,
                        held: None,
                    }),
                }
            }
        }
        c
    }

    /// Answers `req` with the held bytes; its slot goes back unfilled.
    fn serve(&mut self, req: ReadRequest, held: HeldBytes) {
        self.ready.push_back(ReadCompletion {
            tag: req.tag,
            slot: req.slot,
            result: Ok(()),
            elapsed: Duration::ZERO,
            held: Some(held),
        });
    }
}

impl ByteSource for HostTierSource {
    fn files(&self) -> &[SourceFile] {
        self.inner.files()
    }

    fn submit(&mut self, req: ReadRequest) -> Result<()> {
        let key = (req.file, req.offset, req.len);
        if let Some(held) = self.store.get(&key) {
            self.serve(req, held);
            return Ok(());
        }
        let keep = self.store.keeps(&key);
        if keep && self.pending.values().any(|(k, _)| *k == key) {
            self.waiting.entry(key).or_default().push(req);
            return Ok(());
        }
        let tag = req.tag;
        self.inner.submit(req)?;
        self.pending.insert(tag, (key, keep));
        Ok(())
    }

    fn poll_completion(&mut self) -> Option<ReadCompletion> {
        if let Some(c) = self.ready.pop_front() {
            return Some(c);
        }
        let c = self.inner.poll_completion()?;
        Some(self.arrived(c))
    }

    fn wait_completion(&mut self) -> Option<ReadCompletion> {
        if let Some(c) = self.ready.pop_front() {
            return Some(c);
        }
        let c = self.inner.wait_completion()?;
        Some(self.arrived(c))
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
            + self.ready.len()
            + self.waiting.values().map(Vec::len).sum::<usize>()
    }

    fn busy_time(&self) -> Duration {
        self.inner.busy_time()
    }

    fn consumed(&self, file: usize, offset: u64, len: u64) {
        self.inner.consumed(file, offset, len);
    }

    fn register_waker(&self, waker: &std::task::Waker) {
        if self.ready.is_empty() {
            self.inner.register_waker(waker);
        } else {
            waker.wake_by_ref();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::source::{HostSlot, RangeSource, ThreadedSource};
    use std::sync::atomic::AtomicU64;

    struct Bytes(Vec<SourceFile>, Vec<u8>, Arc<AtomicU64>);
    impl RangeSource for Bytes {
        fn files(&self) -> &[SourceFile] {
            &self.0
        }
        fn read_exact_at(&self, _f: usize, offset: u64, buf: &mut [u8], _w: &str) -> Result<()> {
            self.2.fetch_add(buf.len() as u64, Ordering::Relaxed);
            let o = offset as usize;
            buf.copy_from_slice(&self.1[o..o + buf.len()]);
            Ok(())
        }
    }

    /// Counts the allocations asked of it (as the backend's slot allocator would see them).
    #[derive(Default)]
    struct Counting(std::sync::Mutex<Vec<usize>>);
    impl SlotAllocator for Counting {
        fn allocate(&self, bytes: usize) -> Result<SlotBuffer> {
            self.0.lock().expect("lock").push(bytes);
            Ok(Box::new(HostSlot::new(bytes)))
        }
    }

    /// A host tier keeping `kept` in front of `readers` threads over `data`, with the count of
    /// bytes the data was read for and its store.
    fn tier_over(
        data: &[u8],
        kept: ChunkKey,
        readers: usize,
    ) -> (HostTierSource, Arc<AtomicU64>, SharedStore) {
        let reads = Arc::new(AtomicU64::new(0));
        let src = Arc::new(Bytes(
            vec![SourceFile {
                name: "f".into(),
                len: data.len() as u64,
            }],
            data.to_vec(),
            reads.clone(),
        ));
        let store =
            Arc::new(TierStore::new([kept], &crate::stream::ring::HostAllocator).expect("store"));
        let s = HostTierSource::new(Box::new(ThreadedSource::new(src, readers)), store.clone());
        (s, reads, store)
    }

    /// The bytes a consumer uploads for a completed chunk `len` long: the held ones where the
    /// completion carries them, else the slot's; and whether they were held.
    fn delivered(c: &ReadCompletion, len: usize) -> (Vec<u8>, bool) {
        match &c.held {
            Some(h) => (h.bytes().to_vec(), true),
            None => (c.slot.bytes()[..len].to_vec(), false),
        }
    }

    #[test]
    fn the_store_is_one_allocation_from_the_backends_allocator() {
        let alloc = Counting::default();
        let store = Arc::new(
            TierStore::new([(0, 0, 100), (1, 64, 4096), (0, 0, 100)], &alloc).expect("store"),
        );
        // Each chunk at a multiple of 64 bytes, duplicates once, all in one allocation.
        assert_eq!(*alloc.0.lock().expect("lock"), [128 + 4096]);
        assert_eq!(store.bytes(), 128 + 4096);
        assert!(store.keeps(&(1, 64, 4096)) && !store.keeps(&(1, 0, 4096)));
        assert_eq!(store.held_bytes(), 0);
        assert!(
            store.get(&(0, 0, 100)).is_none(),
            "nothing held before the first read"
        );
        let none = TierStore::new([], &alloc).expect("empty store");
        assert_eq!(none.bytes(), 0);
        assert_eq!(
            alloc.0.lock().expect("lock").len(),
            1,
            "no allocation for no chunks"
        );
    }

    #[test]
    fn kept_chunks_are_read_once_then_served_from_host_memory() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let (mut s, reads, store) = tier_over(&data, (0, 0, 1000), 1);
        let (mut from_source, mut held) = (0, 0);
        let mut tag = 0;
        for pass in 0..3 {
            for &(off, len) in &[(0u64, 1000usize), (1000, 3000)] {
                s.submit(ReadRequest {
                    tag,
                    file: 0,
                    offset: off,
                    len,
                    slot: Box::new(HostSlot::new(4096)),
                    what: "t".into(),
                })
                .expect("submit");
                let c = s.wait_completion().expect("completion");
                assert_eq!(c.tag, tag);
                c.result.as_ref().expect("ok");
                let (bytes, was_held) = delivered(&c, len);
                assert_eq!(bytes, &data[off as usize..off as usize + len]);
                if was_held {
                    held += len;
                } else {
                    from_source += len;
                }
                assert_eq!(was_held, pass > 0 && off == 0, "pass {pass}, offset {off}");
                if pass > 0 && off == 0 {
                    // Served from the store: not copied into the ring slot.
                    assert!(c.slot.bytes()[..len].iter().all(|&b| b == 0));
                }
                tag += 1;
            }
        }
        // The kept chunk once from the source, the other every pass.
        assert_eq!(reads.load(Ordering::Relaxed), 1000 + 3 * 3000);
        assert_eq!((from_source, held), (1000 + 3 * 3000, 2 * 1000));
        assert_eq!(store.held_bytes(), 1000);
    }

    #[test]
    fn a_kept_chunk_asked_again_before_it_arrives_is_read_once() {
        let data: Vec<u8> = (0..2048u32).map(|i| (i % 253) as u8).collect();
        let (mut s, reads, store) = tier_over(&data, (0, 100, 500), 2);
        // A ring deeper than a step: the next pass asks for the chunk while the first read is
        // still in flight.
        for tag in 0..3 {
            s.submit(ReadRequest {
                tag,
                file: 0,
                offset: 100,
                len: 500,
                slot: Box::new(HostSlot::new(512)),
                what: "t".into(),
            })
            .expect("submit");
        }
        assert_eq!(s.in_flight(), 3);
        let mut tags = Vec::new();
        let mut held = 0;
        while let Some(c) = s.wait_completion() {
            c.result.as_ref().expect("ok");
            let (bytes, was_held) = delivered(&c, 500);
            assert_eq!(bytes, &data[100..600]);
            held += usize::from(was_held);
            tags.push(c.tag);
        }
        tags.sort_unstable();
        assert_eq!(tags, [0, 1, 2]);
        assert_eq!(
            reads.load(Ordering::Relaxed),
            500,
            "read from the source once"
        );
        assert_eq!(held, 2, "the two later reads answered with held bytes");
        assert_eq!(store.held_bytes(), 500);
    }
}
