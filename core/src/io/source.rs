//! Byte sources: where weights come from. Two layers:
//!
//! - [`RangeSource`]: positional reads of whole ranges of a model's files (local files, HTTP
//!   Range requests). Used to open models (headers, small tensors) and by reader threads.
//! - [`ByteSource`]: the streaming interface the prefetcher drives. Requests are *submitted*
//!   with the ring slot they fill and *completed* later, so that the browser's asynchronous
//!   `fetch` can implement it; nothing in the trait assumes blocking I/O. Natively,
//!   [`ThreadedSource`] implements it with a pool of reader threads over a `RangeSource`.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use web_time::Instant;

use crate::error::{Error, Result};

/// Memory of one staging-ring slot. The backend supplies it: plain aligned host memory for the
/// CPU backend, pinned memory for CUDA, mapped staging buffers for wgpu.
pub trait SlotMemory: Send {
    /// The slot's bytes.
    fn bytes(&self) -> &[u8];
    /// The slot's bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// An owned ring slot; moving it never reallocates.
pub type SlotBuffer = Box<dyn SlotMemory>;

/// Plain host memory aligned to [`HostSlot::ALIGN`] bytes (enough for `O_DIRECT`).
#[derive(Debug)]
pub struct HostSlot {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl HostSlot {
    /// Alignment of the slot's first byte.
    pub const ALIGN: usize = 4096;

    /// Allocates and touches `len` bytes (so they count in RSS from the start, not mid-run).
    /// Panics if the allocation is refused; [`HostSlot::try_new`] returns the error.
    pub fn new(len: usize) -> Self {
        Self::try_new(len).expect("allocating a host slot")
    }

    /// [`HostSlot::new`], or an error when the allocation is refused.
    pub fn try_new(len: usize) -> crate::error::Result<Self> {
        let mut raw = crate::error::zeroed::<u8>(
            len.saturating_add(Self::ALIGN),
            &format!("a ring slot of {len} bytes"),
        )?;
        // A zeroed allocation is not resident until written: touch every page now, so that the
        // ring counts in RSS from the start and not in the middle of a run.
        for page in raw.chunks_mut(4096) {
            // SAFETY: a valid, exclusive pointer into `raw`.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
        let start = raw.as_ptr().align_offset(Self::ALIGN).min(Self::ALIGN);
        Ok(HostSlot { raw, start, len })
    }
}

impl SlotMemory for HostSlot {
    fn bytes(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// Parses an HTTP `Content-Range: bytes START-END/TOTAL` value (TOTAL may be `*`), for the
/// native HTTP source and the browser's alike.
pub fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let total = if total.trim() == "*" {
        None
    } else {
        Some(total.trim().parse().ok()?)
    };
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?, total))
}

/// One file of a source.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceFile {
    /// Path or URL, as used in messages.
    pub name: String,
    /// Length in bytes.
    pub len: u64,
}

/// Positional, whole-range reads from a model's files.
pub trait RangeSource: Send + Sync {
    /// The files, in index order.
    fn files(&self) -> &[SourceFile];

    /// Fills `buf` with the bytes at `offset` of file `file`. Must fill all of it or fail;
    /// `what` names the tensor for error messages.
    fn read_exact_at(&self, file: usize, offset: u64, buf: &mut [u8], what: &str) -> Result<()>;

    /// A range is no longer needed (lets a source drop its page cache or mapped pages).
    fn consumed(&self, _file: usize, _offset: u64, _len: u64) {}

    /// What changes when file `file`'s bytes change, where the source can tell: a local file's
    /// modification time, an HTTP file's `ETag` and `Last-Modified` as pinned when it was
    /// opened. Keys of derived data (the prompt-embedding cache) include it.
    fn version(&self, _file: usize) -> Option<String> {
        None
    }

    /// A name for the source in messages.
    fn describe(&self) -> String {
        self.files()
            .first()
            .map(|f| f.name.clone())
            .unwrap_or_default()
    }

    /// Checks a range against the file length before reading.
    fn check_range(&self, file: usize, offset: u64, len: u64, what: &str) -> Result<()> {
        check_range(self.files(), file, offset, len, what)
    }
}

/// Several sources read as one: their files one after another (a model and the adapter files
/// bound to it). File `i` of the chain is file `i - first` of the part it falls in.
pub struct ChainSource {
    parts: Vec<(usize, Arc<dyn RangeSource>)>,
    files: Vec<SourceFile>,
}

impl ChainSource {
    /// The files of `parts`, in order.
    pub fn new(parts: Vec<Arc<dyn RangeSource>>) -> Self {
        let mut files = Vec::new();
        let mut chained = Vec::with_capacity(parts.len());
        for p in parts {
            chained.push((files.len(), p.clone()));
            files.extend(p.files().iter().cloned());
        }
        ChainSource {
            parts: chained,
            files,
        }
    }

    fn part(&self, file: usize) -> (&dyn RangeSource, usize) {
        let i = self
            .parts
            .partition_point(|(first, _)| *first <= file)
            .saturating_sub(1);
        let (first, p) = &self.parts[i];
        (p.as_ref(), file - first)
    }
}

impl RangeSource for ChainSource {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn read_exact_at(&self, file: usize, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
        self.check_range(file, offset, buf.len() as u64, what)?;
        let (p, f) = self.part(file);
        p.read_exact_at(f, offset, buf, what)
    }

    fn consumed(&self, file: usize, offset: u64, len: u64) {
        if file < self.files.len() {
            let (p, f) = self.part(file);
            p.consumed(f, offset, len)
        }
    }

    fn version(&self, file: usize) -> Option<String> {
        if file >= self.files.len() {
            return None;
        }
        let (p, f) = self.part(file);
        p.version(f)
    }

    fn describe(&self) -> String {
        self.parts
            .first()
            .map(|(_, p)| p.describe())
            .unwrap_or_default()
    }
}

/// Checks that `len` bytes at `offset` lie inside file `file` of `files`; the error names the
/// file, the tensor (`what`) and the offsets.
pub fn check_range(
    files: &[SourceFile],
    file: usize,
    offset: u64,
    len: u64,
    what: &str,
) -> Result<()> {
    let f = files
        .get(file)
        .ok_or_else(|| Error::Invalid(format!("no file #{file}")))?;
    match offset.checked_add(len) {
        Some(end) if end <= f.len => Ok(()),
        _ => Err(Error::OffsetOutOfRange {
            file: f.name.clone(),
            tensor: what.to_string(),
            offset,
            end: offset.saturating_add(len),
            file_len: f.len,
        }),
    }
}

/// A read submitted to a [`ByteSource`].
pub struct ReadRequest {
    /// Caller's identifier, returned in the completion.
    pub tag: u64,
    /// File index.
    pub file: usize,
    /// Absolute offset.
    pub offset: u64,
    /// Bytes to read into the start of `slot`.
    pub len: usize,
    /// The ring slot to fill (returned in the completion).
    pub slot: SlotBuffer,
    /// Name of the tensor, for errors.
    pub what: String,
}

/// A finished read.
pub struct ReadCompletion {
    /// The request's tag.
    pub tag: u64,
    /// The slot, filled on success (unless the bytes are `held`).
    pub slot: SlotBuffer,
    /// Success, or what went wrong.
    pub result: Result<()>,
    /// Time the read took.
    pub elapsed: Duration,
    /// The bytes, where the source answered from memory of its own (a host tier's chunk):
    /// the slot is then left unfilled.
    pub held: Option<HeldBytes>,
}

/// Memory a source keeps bytes in (the host tier's store): a range of it stays unchanged
/// while a [`HeldBytes`] over it lives.
pub trait HeldMemory: Send + Sync {
    /// The bytes at `offset`, `len` long (a range the memory handed out as held).
    fn held(&self, offset: usize, len: usize) -> &[u8];
}

/// Bytes a source answered a read with from memory of its own: read-only, unchanging, and kept
/// alive by the handle.
#[derive(Clone)]
pub struct HeldBytes {
    mem: std::sync::Arc<dyn HeldMemory>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for HeldBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldBytes")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl HeldBytes {
    /// `len` bytes at `offset` of `mem` (a range `mem` holds unchanged from now on).
    pub fn new(mem: std::sync::Arc<dyn HeldMemory>, offset: usize, len: usize) -> Self {
        HeldBytes { mem, offset, len }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        self.mem.held(self.offset, self.len)
    }
}

/// The streaming interface: submit reads into ring slots, collect completions.
pub trait ByteSource: Send {
    /// The files.
    fn files(&self) -> &[SourceFile];
    /// Starts a read; returns at once.
    fn submit(&mut self, req: ReadRequest) -> Result<()>;
    /// A completed read if one is ready (never blocks).
    fn poll_completion(&mut self) -> Option<ReadCompletion>;
    /// Waits for the next completion; `None` when nothing is in flight. Sources on an event loop
    /// (the browser) use `poll_completion` between turns instead.
    fn wait_completion(&mut self) -> Option<ReadCompletion> {
        while self.in_flight() > 0 {
            if let Some(c) = self.poll_completion() {
                return Some(c);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        None
    }
    /// Requests submitted and not yet returned by a completion.
    fn in_flight(&self) -> usize;
    /// Total wall time during which at least one read was in flight (for overlap figures).
    fn busy_time(&self) -> Duration;
    /// A range is no longer needed.
    fn consumed(&self, _file: usize, _offset: u64, _len: u64) {}
    /// Asks to be woken when the next read completes (async consumers, the browser). A source
    /// that cannot notify wakes at once, so that the consumer polls again instead of hanging.
    fn register_waker(&self, waker: &std::task::Waker) {
        waker.wake_by_ref();
    }
}

impl ByteSource for Box<dyn ByteSource> {
    fn files(&self) -> &[SourceFile] {
        (**self).files()
    }
    fn submit(&mut self, req: ReadRequest) -> Result<()> {
        (**self).submit(req)
    }
    fn poll_completion(&mut self) -> Option<ReadCompletion> {
        (**self).poll_completion()
    }
    fn wait_completion(&mut self) -> Option<ReadCompletion> {
        (**self).wait_completion()
    }
    fn in_flight(&self) -> usize {
        (**self).in_flight()
    }
    fn busy_time(&self) -> Duration {
        (**self).busy_time()
    }
    fn consumed(&self, file: usize, offset: u64, len: u64) {
        (**self).consumed(file, offset, len)
    }
    fn register_waker(&self, waker: &std::task::Waker) {
        (**self).register_waker(waker)
    }
}

#[derive(Debug, Default)]
struct Busy {
    active: usize,
    since: Option<Instant>,
    total: Duration,
}

impl Busy {
    fn start(&mut self) {
        if self.active == 0 {
            self.since = Some(Instant::now());
        }
        self.active += 1;
    }
    fn stop(&mut self) {
        self.active -= 1;
        if self.active == 0 {
            if let Some(s) = self.since.take() {
                self.total += s.elapsed();
            }
        }
    }
    fn total(&self) -> Duration {
        self.total + self.since.map(|s| s.elapsed()).unwrap_or_default()
    }
}

/// A [`ByteSource`] over a [`RangeSource`] with a fixed pool of reader threads (spawned once).
pub struct ThreadedSource {
    inner: Arc<dyn RangeSource>,
    files: Vec<SourceFile>,
    work: Option<mpsc::Sender<ReadRequest>>,
    done: mpsc::Receiver<ReadCompletion>,
    in_flight: usize,
    busy: Arc<Mutex<Busy>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadedSource")
            .field("files", &self.files)
            .field("readers", &self.threads.len())
            .finish()
    }
}

/// The most reader threads a source runs (parallel connections for a URL); more would not read
/// faster and, unbounded, could exhaust the process's threads.
pub const MAX_READERS: usize = 64;

impl ThreadedSource {
    /// Starts `readers` threads (1 to [`MAX_READERS`]) reading from `inner`.
    pub fn new(inner: Arc<dyn RangeSource>, readers: usize) -> Self {
        let (work_tx, work_rx) = mpsc::channel::<ReadRequest>();
        let (done_tx, done_rx) = mpsc::channel();
        let work_rx = Arc::new(Mutex::new(work_rx));
        let busy = Arc::new(Mutex::new(Busy::default()));
        let threads = (0..readers.clamp(1, MAX_READERS))
            .map(|i| {
                let (rx, tx, src, busy) = (
                    work_rx.clone(),
                    done_tx.clone(),
                    inner.clone(),
                    busy.clone(),
                );
                std::thread::Builder::new()
                    .name(format!("nibble-reader-{i}"))
                    .spawn(move || loop {
                        let req = match rx.lock().map(|r| r.recv()) {
                            Ok(Ok(r)) => r,
                            _ => return,
                        };
                        let ReadRequest {
                            tag,
                            file,
                            offset,
                            len,
                            mut slot,
                            what,
                        } = req;
                        let t = Instant::now();
                        let result = match slot.bytes_mut().get_mut(..len) {
                            Some(buf) => src.read_exact_at(file, offset, buf, &what),
                            None => Err(Error::Invalid(format!(
                                "read of {len} bytes does not fit a ring slot of {} bytes",
                                slot.bytes().len()
                            ))),
                        };
                        let elapsed = t.elapsed();
                        if let Ok(mut b) = busy.lock() {
                            b.stop();
                        }
                        if tx
                            .send(ReadCompletion {
                                tag,
                                slot,
                                result,
                                elapsed,
                                held: None,
                            })
                            .is_err()
                        {
                            return;
                        }
                    })
                    .expect("spawn reader thread")
            })
            .collect();
        let files = inner.files().to_vec();
        ThreadedSource {
            inner,
            files,
            work: Some(work_tx),
            done: done_rx,
            in_flight: 0,
            busy,
            threads,
        }
    }
}

impl ByteSource for ThreadedSource {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn submit(&mut self, req: ReadRequest) -> Result<()> {
        self.inner
            .check_range(req.file, req.offset, req.len as u64, &req.what)?;
        if let Ok(mut b) = self.busy.lock() {
            b.start();
        }
        let work = self
            .work
            .as_ref()
            .ok_or_else(|| Error::Invalid("source closed".into()))?;
        work.send(req)
            .map_err(|_| Error::Invalid("reader threads have stopped".into()))?;
        self.in_flight += 1;
        Ok(())
    }

    fn poll_completion(&mut self) -> Option<ReadCompletion> {
        let c = self.done.try_recv().ok()?;
        self.in_flight -= 1;
        Some(c)
    }

    fn wait_completion(&mut self) -> Option<ReadCompletion> {
        if self.in_flight == 0 {
            return None;
        }
        let c = self.done.recv().ok()?;
        self.in_flight -= 1;
        Some(c)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn busy_time(&self) -> Duration {
        self.busy.lock().map(|b| b.total()).unwrap_or_default()
    }

    fn consumed(&self, file: usize, offset: u64, len: u64) {
        self.inner.consumed(file, offset, len);
    }
}

impl Drop for ThreadedSource {
    fn drop(&mut self) {
        self.work = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
