//! The host tier: a [`ByteSource`] in front of the model's source that keeps the bytes of the
//! chunks it is told to keep after their first read, and answers later reads of them from host
//! memory (a copy into the ring slot) without asking the source again. Reads of other chunks go
//! to the source as before. It counts the bytes each side delivered.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::io::source::{ByteSource, ReadCompletion, ReadRequest, SourceFile};

/// A chunk: file, offset, length.
pub type ChunkKey = (usize, u64, usize);

/// Bytes delivered from the source and from host memory since the tier was made.
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Read from the model's source (disk, HTTP).
    pub source: AtomicU64,
    /// Copied from the host tier.
    pub host: AtomicU64,
}

impl TierCounters {
    /// (source, host) so far.
    pub fn get(&self) -> (u64, u64) {
        (
            self.source.load(Ordering::Relaxed),
            self.host.load(Ordering::Relaxed),
        )
    }
}

/// The caching source.
pub struct HostTierSource {
    inner: Box<dyn ByteSource>,
    keep: HashSet<ChunkKey>,
    held: HashMap<ChunkKey, Vec<u8>>,
    /// Reads sent to the source, by tag: the chunk and whether to keep its bytes.
    pending: HashMap<u64, (ChunkKey, bool)>,
    /// Later reads of a kept chunk whose first read is still in flight (a ring deeper than one
    /// step): served from host memory when it arrives, never read twice.
    waiting: HashMap<ChunkKey, Vec<ReadRequest>>,
    ready: VecDeque<ReadCompletion>,
    counters: Arc<TierCounters>,
}

impl std::fmt::Debug for HostTierSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTierSource")
            .field("keep", &self.keep.len())
            .field("held", &self.held.len())
            .finish()
    }
}

impl HostTierSource {
    /// In front of `inner`, keeping the chunks `keep`; `counters` count what each side gave.
    pub fn new(
        inner: Box<dyn ByteSource>,
        keep: HashSet<ChunkKey>,
        counters: Arc<TierCounters>,
    ) -> Self {
        HostTierSource {
            inner,
            keep,
            held: HashMap::new(),
            pending: HashMap::new(),
            waiting: HashMap::new(),
            ready: VecDeque::new(),
            counters,
        }
    }

    /// Bytes held in host memory now.
    pub fn held_bytes(&self) -> u64 {
        self.held.values().map(|v| v.len() as u64).sum()
    }

    /// A completion from the source: counted, its bytes kept when asked, and the reads that
    /// waited for it answered (from host memory; with its error if it failed).
    fn arrived(&mut self, c: ReadCompletion) -> ReadCompletion {
        if let Some((key, keep)) = self.pending.remove(&c.tag) {
            if c.result.is_ok() {
                self.counters
                    .source
                    .fetch_add(key.2 as u64, Ordering::Relaxed);
                if keep && !self.held.contains_key(&key) {
                    self.held.insert(key, c.slot.bytes()[..key.2].to_vec());
                }
            }
            for req in self.waiting.remove(&key).unwrap_or_default() {
                match &c.result {
                    Ok(()) => self.serve(req, key.2),
                    Err(e) => self.ready.push_back(ReadCompletion {
                        tag: req.tag,
                        slot: req.slot,
                        result: Err(crate::error::Error::Invalid(format!(
                            "{}: the read this chunk waited for failed: {e}",
                            req.what
                        ))),
                        elapsed: Duration::ZERO,
                    }),
                }
            }
        }
        c
    }

    /// Answers `req` from host memory.
    fn serve(&mut self, mut req: ReadRequest, bytes_len: usize) {
        if let Some(bytes) = self.held.get(&(req.file, req.offset, req.len)) {
            req.slot.bytes_mut()[..bytes_len].copy_from_slice(bytes);
        }
        self.counters
            .host
            .fetch_add(bytes_len as u64, Ordering::Relaxed);
        self.ready.push_back(ReadCompletion {
            tag: req.tag,
            slot: req.slot,
            result: Ok(()),
            elapsed: Duration::ZERO,
        });
    }
}

impl ByteSource for HostTierSource {
    fn files(&self) -> &[SourceFile] {
        self.inner.files()
    }

    fn submit(&mut self, req: ReadRequest) -> Result<()> {
        let key = (req.file, req.offset, req.len);
        if let Some(n) = self.held.get(&key).map(|b| b.len()) {
            self.serve(req, n);
            return Ok(());
        }
        let keep = self.keep.contains(&key);
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

    /// A host tier keeping `kept` in front of `readers` threads over `data`, with the count of
    /// bytes the data was read for and the tier's counters.
    fn tier_over(
        data: &[u8],
        kept: ChunkKey,
        readers: usize,
    ) -> (HostTierSource, Arc<AtomicU64>, Arc<TierCounters>) {
        let reads = Arc::new(AtomicU64::new(0));
        let src = Arc::new(Bytes(
            vec![SourceFile {
                name: "f".into(),
                len: data.len() as u64,
            }],
            data.to_vec(),
            reads.clone(),
        ));
        let counters = Arc::new(TierCounters::default());
        let s = HostTierSource::new(
            Box::new(ThreadedSource::new(src, readers)),
            [kept].into_iter().collect(),
            counters.clone(),
        );
        (s, reads, counters)
    }

    #[test]
    fn kept_chunks_are_read_once_then_served_from_host_memory() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let (mut s, reads, counters) = tier_over(&data, (0, 0, 1000), 1);
        let mut tag = 0;
        for _pass in 0..3 {
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
                c.result.expect("ok");
                assert_eq!(
                    &c.slot.bytes()[..len],
                    &data[off as usize..off as usize + len]
                );
                tag += 1;
            }
        }
        // The kept chunk once from the source, the other every pass.
        assert_eq!(reads.load(Ordering::Relaxed), 1000 + 3 * 3000);
        assert_eq!(counters.get(), (1000 + 3 * 3000, 2 * 1000));
        assert_eq!(s.held_bytes(), 1000);
    }

    #[test]
    fn a_kept_chunk_asked_again_before_it_arrives_is_read_once() {
        let data: Vec<u8> = (0..2048u32).map(|i| (i % 253) as u8).collect();
        let (mut s, reads, counters) = tier_over(&data, (0, 100, 500), 2);
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
        while let Some(c) = s.wait_completion() {
            c.result.expect("ok");
            assert_eq!(&c.slot.bytes()[..500], &data[100..600]);
            tags.push(c.tag);
        }
        tags.sort_unstable();
        assert_eq!(tags, [0, 1, 2]);
        assert_eq!(
            reads.load(Ordering::Relaxed),
            500,
            "read from the source once"
        );
        assert_eq!(counters.get(), (500, 1000));
    }
}
