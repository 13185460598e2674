//! The prefetch pipeline: reads fill ring slots in schedule order ahead of the consumer, bounded
//! by the ring; the consumer's [`Prefetcher::next_chunk`] blocks only when the chunk it needs next has
//! not arrived. A tensor larger than a slot streams through in chunks. Per-step statistics
//! (bytes, read time, consumer stall) come out as [`StepStats`].

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use web_time::Instant;

use crate::error::{Error, Result};
use crate::format::safetensors::TensorEntry;
use crate::io::source::{ByteSource, HeldBytes, ReadCompletion, ReadRequest};
use crate::stream::ring::{EmptySlot, SlotGuard, StagingRing};

/// The piece of one tensor that a chunk carries.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkPart {
    /// Tensor name.
    pub tensor: String,
    /// Offset of this piece within the tensor.
    pub tensor_offset: u64,
    /// The tensor's total bytes.
    pub tensor_len: u64,
    /// Where the piece starts in the chunk.
    pub chunk_offset: usize,
    /// Bytes of the piece.
    pub len: usize,
}

/// One read into one ring slot: a piece of a large tensor, or several small tensors that lie
/// next to each other in the file (one read instead of many, so that small tensors do not each
/// take a slot of the pipeline).
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkSpec {
    /// Weight group (index into the plan's groups).
    pub group: usize,
    /// File index.
    pub file: usize,
    /// Absolute offset in the file.
    pub offset: u64,
    /// Bytes (at most one slot).
    pub len: usize,
    /// The tensors it carries, in file order.
    pub parts: Vec<ChunkPart>,
}

impl ChunkSpec {
    /// Names of the tensors it carries, for messages.
    pub fn what(&self) -> String {
        match self.parts.as_slice() {
            [one] => one.tensor.clone(),
            [first, .., last] => format!("{} .. {}", first.tensor, last.tensor),
            [] => String::new(),
        }
    }
}

/// Splits the tensors of each group into slot-sized reads, in order: a tensor larger than a slot
/// streams through in several chunks; neighbouring tensors of one group that are contiguous in
/// the same file share a chunk while they fit.
pub fn chunk_schedule<'a>(
    groups: impl IntoIterator<Item = (usize, &'a [TensorEntry])>,
    slot_bytes: usize,
) -> Vec<ChunkSpec> {
    let slot = slot_bytes as u64;
    let mut out: Vec<ChunkSpec> = Vec::new();
    for (g, tensors) in groups {
        let mut open: Option<ChunkSpec> = None;
        for t in tensors {
            let mut done = 0u64;
            loop {
                let piece = (t.len - done).min(slot);
                let fits = open.as_ref().is_some_and(|c| {
                    c.file == t.shard
                        && c.offset + c.len as u64 == t.offset + done
                        && c.len as u64 + piece <= slot
                });
                if !fits {
                    out.extend(open.take());
                    open = Some(ChunkSpec {
                        group: g,
                        file: t.shard,
                        offset: t.offset + done,
                        len: 0,
                        parts: Vec::new(),
                    });
                }
                let c = open.as_mut().expect("a chunk is open");
                c.parts.push(ChunkPart {
                    tensor: t.name.clone(),
                    tensor_offset: done,
                    tensor_len: t.len,
                    chunk_offset: c.len,
                    len: piece as usize,
                });
                c.len += piece as usize;
                done += piece;
                if done >= t.len {
                    break;
                }
            }
        }
        out.extend(open.take());
    }
    out
}

/// What one pass over the schedule cost.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepStats {
    /// Step number, from 0.
    pub step: u64,
    /// Wall time from the first chunk handed out to the last chunk handed out of the step
    /// (including the consumer's time in between).
    pub wall: Duration,
    /// Bytes delivered.
    pub bytes: u64,
    /// Time the consumer waited in `next_chunk()`.
    pub stall: Duration,
    /// Time during which at least one read was in flight.
    pub read_busy: Duration,
}

/// Where a chunk's bytes are.
#[derive(Debug)]
pub enum ChunkData {
    /// In a ring slot, read from the source; the slot returns to the ring when the guard is
    /// released.
    Slot(SlotGuard),
    /// In the host tier's memory (read from the source at an earlier step and kept); its slot
    /// went back to the ring at once.
    Held(HeldBytes),
}

/// A chunk handed to the consumer.
#[derive(Debug)]
pub struct Chunk {
    /// What it is.
    pub spec: ChunkSpec,
    /// Global sequence number (step * chunks per step + index).
    pub seq: u64,
    /// Its bytes: a ring slot or host-tier memory.
    pub data: ChunkData,
}

impl Chunk {
    /// The chunk's bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            ChunkData::Slot(s) => s.bytes(),
            ChunkData::Held(h) => h.bytes(),
        }
    }

    /// Whether the bytes came from the host tier rather than the source.
    pub fn held(&self) -> bool {
        matches!(self.data, ChunkData::Held(_))
    }

    /// Releases the chunk once `fence` signals (its slot back to the ring then; held bytes
    /// need no fence here: the host tier waits for its last upload before it is freed).
    pub fn release_after(self, fence: Box<dyn crate::stream::ring::Fence>) {
        match self.data {
            ChunkData::Slot(s) => s.release_after(fence),
            ChunkData::Held(_) => fence.wait(),
        }
    }
}

/// A read that completed before the consumer reached it.
enum Arrived {
    Slot(EmptySlot),
    Held(HeldBytes),
}

/// Drives a [`ByteSource`] through a [`StagingRing`] over a repeating schedule.
pub struct Prefetcher<S: ByteSource> {
    source: S,
    ring: StagingRing,
    chunks: Vec<ChunkSpec>,
    total: Option<u64>,
    next_submit: u64,
    next_consume: u64,
    in_flight: HashMap<u64, usize>,
    ready: BTreeMap<u64, Arrived>,
    /// Bytes the completed reads delivered from the source and from held memory (the host
    /// tier), counted as they arrive (reads run ahead of the consumer by up to the ring).
    delivered: (u64, u64),
    /// Reads that failed before the consumer reached them.
    failed: HashMap<u64, Error>,
    cur: StepStats,
    step_start: Option<Instant>,
    busy_at_step_start: Duration,
    finished: Option<StepStats>,
}

impl<S: ByteSource> std::fmt::Debug for Prefetcher<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher")
            .field("chunks_per_step", &self.chunks.len())
            .field("next_consume", &self.next_consume)
            .finish()
    }
}

impl<S: ByteSource> Prefetcher<S> {
    /// A pipeline over `chunks` repeated `steps` times (`None`: until dropped).
    pub fn new(
        source: S,
        ring: StagingRing,
        chunks: Vec<ChunkSpec>,
        steps: Option<u64>,
    ) -> Result<Self> {
        if let Some(c) = chunks.iter().find(|c| c.len > ring.slot_bytes()) {
            return Err(Error::Invalid(format!(
                "chunk of '{}' is {} bytes, larger than a ring slot ({} bytes)",
                c.what(),
                c.len,
                ring.slot_bytes()
            )));
        }
        let total = steps.map(|s| s * chunks.len() as u64);
        Ok(Prefetcher {
            source,
            ring,
            chunks,
            total,
            next_submit: 0,
            next_consume: 0,
            in_flight: HashMap::new(),
            ready: BTreeMap::new(),
            delivered: (0, 0),
            failed: HashMap::new(),
            cur: StepStats::default(),
            step_start: None,
            busy_at_step_start: Duration::ZERO,
            finished: None,
        })
    }

    /// Gives the ring back (once every chunk handed out has been released).
    pub fn into_ring(self) -> StagingRing {
        self.ring
    }

    /// Stops reading ahead: waits for the reads in flight, returns their slots and those of
    /// chunks that arrived but were not consumed, and gives the ring back whole.
    pub fn finish(mut self) -> StagingRing {
        while let Some(done) = self.source.wait_completion() {
            if let Some(index) = self.in_flight.remove(&done.tag) {
                self.ring.give_back(EmptySlot {
                    index,
                    buf: done.slot,
                });
            }
        }
        for (_, a) in std::mem::take(&mut self.ready) {
            if let Arrived::Slot(slot) = a {
                self.ring.give_back(slot);
            }
        }
        self.ring
    }

    /// Bytes the completed reads delivered so far: (from the source, from the host tier).
    pub fn delivered(&self) -> (u64, u64) {
        self.delivered
    }

    /// Files a completion: its slot back to the ring at once when its bytes are held (the
    /// host tier answered), counted either way; a failure kept for the consumer.
    fn arrived(&mut self, done: ReadCompletion, index: usize) -> Option<Error> {
        let slot = EmptySlot {
            index,
            buf: done.slot,
        };
        if let Err(e) = done.result {
            self.ring.give_back(slot);
            return Some(e);
        }
        let len = self.chunks[(done.tag % self.chunks.len() as u64) as usize].len as u64;
        let a = match done.held {
            Some(h) => {
                self.ring.give_back(slot);
                self.delivered.1 += len;
                Arrived::Held(h)
            }
            None => {
                self.delivered.0 += len;
                Arrived::Slot(slot)
            }
        };
        self.ready.insert(done.tag, a);
        None
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The ring.
    pub fn ring(&self) -> &StagingRing {
        &self.ring
    }

    /// The `idx`-th chunk of a step.
    pub fn chunk_spec(&self, idx: usize) -> Option<&ChunkSpec> {
        self.chunks.get(idx)
    }

    /// Chunks per step.
    pub fn chunks_per_step(&self) -> usize {
        self.chunks.len()
    }

    fn more_to_submit(&self) -> bool {
        !self.chunks.is_empty() && self.total.is_none_or(|t| self.next_submit < t)
    }

    fn fill(&mut self) -> Result<()> {
        while self.more_to_submit() {
            let Some(slot) = self.ring.try_acquire() else {
                break;
            };
            let seq = self.next_submit;
            let spec = &self.chunks[(seq % self.chunks.len() as u64) as usize];
            self.in_flight.insert(seq, slot.index);
            let req = ReadRequest {
                tag: seq,
                file: spec.file,
                offset: spec.offset,
                len: spec.len,
                slot: slot.buf,
                what: spec.what(),
            };
            self.source.submit(req)?;
            self.next_submit += 1;
        }
        Ok(())
    }

    /// The next chunk in schedule order (`None` after the last step). Blocks only while that
    /// chunk's read is still in flight.
    pub fn next_chunk(&mut self) -> Result<Option<Chunk>> {
        if self.total.is_some_and(|t| self.next_consume >= t) || self.chunks.is_empty() {
            return Ok(None);
        }
        if self.step_start.is_none() {
            self.step_start = Some(Instant::now());
            self.busy_at_step_start = self.source.busy_time();
        }
        let mut waited = Duration::ZERO;
        let arrived = loop {
            self.fill()?;
            if let Some(s) = self.ready.remove(&self.next_consume) {
                break s;
            }
            if let Some(e) = self.failed.remove(&self.next_consume) {
                return Err(e);
            }
            let t = Instant::now();
            let Some(done) = self.source.wait_completion() else {
                return Err(Error::Invalid(
                    "all ring slots are held by the consumer: release chunks before asking for more".into(),
                ));
            };
            waited += t.elapsed();
            let index = self
                .in_flight
                .remove(&done.tag)
                .ok_or_else(|| Error::Invalid("unknown read completed".into()))?;
            if let Some(e) = self.arrived(done, index) {
                return Err(e);
            }
        };
        let seq = self.next_consume;
        let per = self.chunks.len() as u64;
        let spec = self.chunks[(seq % per) as usize].clone();
        self.source
            .consumed(spec.file, spec.offset, spec.len as u64);
        self.cur.bytes += spec.len as u64;
        self.cur.stall += waited;
        self.next_consume += 1;
        if self.next_consume.is_multiple_of(per) {
            let now = Instant::now();
            let mut st = self.cur;
            st.step = seq / per;
            st.wall = self.step_start.map(|s| now - s).unwrap_or_default();
            st.read_busy = self
                .source
                .busy_time()
                .saturating_sub(self.busy_at_step_start);
            self.finished = Some(st);
            self.cur = StepStats::default();
            self.step_start = None;
        }
        let data = match arrived {
            Arrived::Slot(slot) => ChunkData::Slot(self.ring.filled(slot, spec.len)),
            Arrived::Held(h) => ChunkData::Held(h),
        };
        Ok(Some(Chunk { spec, seq, data }))
    }

    /// Whether the next chunk has arrived (so that `next_chunk` will not wait for it).
    pub fn next_ready(&mut self) -> bool {
        while let Some(done) = self.source.poll_completion() {
            let Some(index) = self.in_flight.remove(&done.tag) else {
                continue;
            };
            let tag = done.tag;
            if let Some(e) = self.arrived(done, index) {
                // next_chunk reports it when the consumer gets there.
                self.failed.insert(tag, e);
            }
        }
        self.ready.contains_key(&self.next_consume) || self.failed.contains_key(&self.next_consume)
    }

    /// Starts the reads that free slots allow and says whether `next_chunk` can answer without
    /// waiting: the next chunk arrived (or failed), the schedule is over, or nothing is in
    /// flight (so `next_chunk` reports the stall as an error). Never blocks.
    pub fn poll_ready(&mut self) -> Result<bool> {
        if self.total.is_some_and(|t| self.next_consume >= t) || self.chunks.is_empty() {
            return Ok(true);
        }
        self.fill()?;
        Ok(self.next_ready() || self.in_flight.is_empty())
    }

    /// Waits, without blocking the thread, until `next_chunk` can answer at once (for async
    /// consumers: the browser's event loop delivers the source's completions).
    pub async fn ready(&mut self) -> Result<()> {
        std::future::poll_fn(|cx| match self.poll_ready() {
            Ok(true) => std::task::Poll::Ready(Ok(())),
            Err(e) => std::task::Poll::Ready(Err(e)),
            Ok(false) => {
                self.source.register_waker(cx.waker());
                // A completion may have landed between the check and the registration.
                match self.poll_ready() {
                    Ok(false) => std::task::Poll::Pending,
                    r => std::task::Poll::Ready(r.map(|_| ())),
                }
            }
        })
        .await
    }

    /// Limits the schedule to `passes` more passes from the start of the next one (reads stop
    /// there instead of running ahead into a pass that will not come).
    pub fn limit_passes(&mut self, passes: u64) {
        let per = self.chunks.len() as u64;
        let start = self.next_consume.div_ceil(per.max(1)) * per;
        self.total = Some(start + passes * per);
    }

    /// Statistics of the step that the last `next_chunk()` completed, once.
    pub fn take_step_stats(&mut self) -> Option<StepStats> {
        self.finished.take()
    }
}
