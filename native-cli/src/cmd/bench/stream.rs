//! `nibble bench stream`: every weight of a model streamed S times through the ring into a
//! consumer that costs X ms per MiB, against a plain sequential read (file) or plain GETs (URL)
//! of the same bytes measured in the same run.

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nibble_core::io::file::{FileReadMode, FileSource};
use nibble_core::io::machine::rss_bytes;
use nibble_core::io::source::{RangeSource, ThreadedSource};
use nibble_core::plan::fmt_bytes;
use nibble_core::stream::prefetch::{chunk_schedule, Prefetcher};
use nibble_core::stream::ring::{HostAllocator, StagingRing};
use serde_json::json;

use super::StreamArgs;

/// A device the chunks are uploaded to.
trait Sink {
    fn put(&mut self, chunk: nibble_core::stream::prefetch::Chunk) -> Result<()>;
}

/// The uploads alternate between two slot-sized regions of the backend's pool; the ring slot is
/// released when the upload's fence signals.
struct DeviceSink<B: nibble_core::backend::Backend> {
    backend: B,
    slot: u64,
    next: u64,
}

impl<B: nibble_core::backend::Backend> Sink for DeviceSink<B> {
    fn put(&mut self, chunk: nibble_core::stream::prefetch::Chunk) -> Result<()> {
        let at = (self.next % 2) * self.slot;
        self.next += 1;
        let fence = self.backend.upload(at, chunk.bytes())?;
        chunk.release_after(fence);
        Ok(())
    }
}

struct MakeSink {
    slot: u64,
}

impl crate::backends::WithBackend for MakeSink {
    type Output = (
        Box<dyn Sink>,
        Option<Box<dyn nibble_core::stream::ring::SlotAllocator>>,
        String,
    );
    fn call<B: nibble_core::backend::Backend + 'static>(
        self,
        mut backend: B,
        label: &str,
    ) -> Result<Self::Output> {
        backend.allocate(1, 2 * self.slot, 0)?;
        let alloc = backend.slot_allocator();
        let sink: Box<dyn Sink> = Box::new(DeviceSink {
            backend,
            slot: self.slot,
            next: 0,
        });
        Ok((sink, alloc, label.to_string()))
    }
}

/// What a step measured.
#[derive(Debug, Clone, Copy)]
struct Step {
    wall: Duration,
    bytes: u64,
    stall: Duration,
    read_busy: Duration,
    consume: Duration,
    rss: u64,
}

fn is_url(s: &str) -> bool {
    s.starts_with("http://") || s.starts_with("https://")
}

/// The simulated compute: holds the slot for `ms_per_mib` per MiB without using a core (the
/// machine's cores stay with the readers, as they would while a GPU computes). Sleeps are
/// batched through `owed` so that many tiny tensors do not each pay the scheduler's minimum.
fn consume(bytes: &[u8], ms_per_mib: f64, owed: &mut f64) -> u64 {
    *owed += ms_per_mib * bytes.len() as f64 / (1u64 << 20) as f64 / 1000.0;
    if *owed >= 0.001 {
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(*owed));
        *owed -= t.elapsed().as_secs_f64();
    }
    // One byte per page, so that the slot is really read.
    bytes.iter().step_by(4096).map(|&b| b as u64).sum()
}

/// Plain sequential read of every byte of every file (local) or one plain GET per file (URL).
fn baseline(model: &str, files: &[String], buf: &mut [u8]) -> Result<(u64, Duration)> {
    let t = Instant::now();
    let mut total = 0u64;
    for f in files {
        let mut r: Box<dyn Read> = if is_url(model) {
            let resp = ureq::get(f).call().with_context(|| format!("GET {f}"))?;
            Box::new(resp.into_body().into_reader())
        } else {
            Box::new(std::fs::File::open(f).with_context(|| f.clone())?)
        };
        loop {
            let n = r.read(buf).with_context(|| f.clone())?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok((total, t.elapsed()))
}

/// Runs the benchmark and prints the per-step table or the JSON object.
pub fn run(o: &StreamArgs) -> Result<()> {
    let index = nibble_core::io::model::ModelIndex::open_path_or_url(&o.model, o.file_mode.into())?;
    let (source, resolved_mode): (Arc<dyn RangeSource>, Option<FileReadMode>) = if is_url(&o.model)
    {
        (index.source(), None)
    } else {
        let paths: Vec<std::path::PathBuf> = index
            .source()
            .files()
            .iter()
            .map(|f| f.name.clone().into())
            .collect();
        let fs = FileSource::open(&paths, o.file_mode.into())?;
        let mode = fs.mode();
        (Arc::new(fs), Some(mode))
    };
    let files: Vec<String> = source.files().iter().map(|f| f.name.clone()).collect();
    let tensors: Vec<_> = index.tensors().cloned().collect();
    let by_shard: Vec<(usize, Vec<_>)> = (0..index.shards.len())
        .map(|s| {
            (
                s,
                tensors.iter().filter(|t| t.shard == s).cloned().collect(),
            )
        })
        .collect();
    let chunks = chunk_schedule(
        by_shard.iter().map(|(g, t)| (*g, t.as_slice())),
        o.slot_bytes,
    );
    let step_bytes: u64 = chunks.iter().map(|c| c.len as u64).sum();
    let (mut sink, alloc, sink_label) = match &o.backend {
        Some(b) => {
            let (s, a, l) = crate::backends::select(*b)?.run(MakeSink {
                slot: o.slot_bytes as u64,
            })?;
            (Some(s), a, Some(l))
        }
        None => (None, None, None),
    };
    let ring = match &alloc {
        Some(a) => StagingRing::new(o.slots, o.slot_bytes, a.as_ref())?,
        None => StagingRing::new(o.slots, o.slot_bytes, &HostAllocator)?,
    };
    let threaded = ThreadedSource::new(source.clone(), o.readers);
    let mut pf = Prefetcher::new(threaded, ring, chunks, Some(o.steps))?;
    if !o.json {
        eprintln!(
            "streaming {} ({} in {} tensors) {} times through {} x {} slots, {} readers, consumer {} ms/MiB{}",
            o.model,
            fmt_bytes(step_bytes),
            tensors.len(),
            o.steps,
            o.slots,
            fmt_bytes(o.slot_bytes as u64),
            o.readers,
            o.consume_ms_per_mib,
            resolved_mode.map(|m| format!(", file mode {}", m.name())).unwrap_or_default()
        );
        if let Some(l) = &sink_label {
            eprintln!("consumer: uploads to {l}");
        }
        eprintln!(
            "{:>5} {:>10} {:>12} {:>10} {:>10} {:>12}",
            "step", "wall ms", "bytes", "MiB/s", "stall ms", "RSS"
        );
    }
    let mut steps: Vec<Step> = Vec::with_capacity(o.steps as usize);
    let mut consume_t = Duration::ZERO;
    let mut checksum = 0u64;
    let mut owed = 0f64;
    let t_all = Instant::now();
    while let Some(chunk) = pf.next_chunk()? {
        let t = Instant::now();
        match sink.as_mut() {
            Some(s) => s.put(chunk)?,
            None => {
                checksum =
                    checksum.wrapping_add(consume(chunk.bytes(), o.consume_ms_per_mib, &mut owed));
                drop(chunk);
            }
        }
        consume_t += t.elapsed();
        if let Some(st) = pf.take_step_stats() {
            let s = Step {
                wall: st.wall,
                bytes: st.bytes,
                stall: st.stall,
                read_busy: st.read_busy,
                consume: std::mem::take(&mut consume_t),
                rss: rss_bytes().unwrap_or(0),
            };
            if !o.json {
                eprintln!(
                    "{:>5} {:>10.1} {:>12} {:>10.1} {:>10.1} {:>12}",
                    st.step + 1,
                    s.wall.as_secs_f64() * 1e3,
                    s.bytes,
                    s.bytes as f64 / (1u64 << 20) as f64 / s.wall.as_secs_f64().max(1e-9),
                    s.stall.as_secs_f64() * 1e3,
                    fmt_bytes(s.rss)
                );
            }
            steps.push(s);
        }
    }
    let wall = t_all.elapsed();
    std::hint::black_box(checksum);
    drop(pf);
    // The baseline reads into a buffer of one slot's size, twice (their mean), under the same
    // cache conditions as the stream: modes that bypass or drop the page cache get a baseline
    // read from disk.
    let cold = matches!(
        resolved_mode,
        Some(FileReadMode::PreadDropCache | FileReadMode::Direct)
    );
    let mut buf = vec![0u8; o.slot_bytes];
    let mut base_runs = Vec::new();
    for _ in 0..2 {
        if cold {
            for f in &files {
                nibble_core::io::file::drop_file_cache(std::path::Path::new(f))?;
            }
        }
        base_runs.push(baseline(&o.model, &files, &mut buf)?);
    }
    let base_bytes: u64 = base_runs.iter().map(|r| r.0).sum();
    let base_t: Duration = base_runs.iter().map(|r| r.1).sum();
    let mib = |b: u64, t: Duration| b as f64 / (1u64 << 20) as f64 / t.as_secs_f64().max(1e-9);
    let total_bytes: u64 = steps.iter().map(|s| s.bytes).sum();
    let throughput = mib(total_bytes, wall);
    let baseline_mib_s = mib(base_bytes, base_t);
    let read_total: Duration = steps.iter().map(|s| s.read_busy).sum();
    let consume_total: Duration = steps.iter().map(|s| s.consume).sum();
    let overlap = read_total.max(consume_total).as_secs_f64() / wall.as_secs_f64().max(1e-9);
    let rss_first = steps.first().map(|s| s.rss).unwrap_or(0);
    let rss_last = steps.last().map(|s| s.rss).unwrap_or(0);
    let rss_max = steps.iter().map(|s| s.rss).max().unwrap_or(0);
    let ratio = throughput / baseline_mib_s.max(1e-9);
    if o.json {
        let out = json!({
            "model": o.model,
            "steps": steps.iter().map(|s| json!({
                "wall_ms": s.wall.as_secs_f64() * 1e3,
                "bytes": s.bytes,
                "stall_ms": s.stall.as_secs_f64() * 1e3,
                "read_ms": s.read_busy.as_secs_f64() * 1e3,
                "consume_ms": s.consume.as_secs_f64() * 1e3,
                "rss_bytes": s.rss,
            })).collect::<Vec<_>>(),
            "summary": {
                "throughput_mib_s": throughput,
                "baseline_mib_s": baseline_mib_s,
                "ratio": ratio,
                "rss_first_bytes": rss_first,
                "rss_last_bytes": rss_last,
                "rss_max_bytes": rss_max,
                "overlap_efficiency": overlap,
                "ring_bytes": (o.slots * o.slot_bytes) as u64,
                "read_ms": read_total.as_secs_f64() * 1e3,
                "consume_ms": consume_total.as_secs_f64() * 1e3,
                "wall_ms": wall.as_secs_f64() * 1e3,
                "file_mode": resolved_mode.map(|m| m.name()),
            }
        });
        crate::output::write_stdout(&format!("{}\n", serde_json::to_string_pretty(&out)?))?;
    } else {
        eprintln!(
            "throughput {throughput:.1} MiB/s, baseline ({}) {baseline_mib_s:.1} MiB/s, ratio {ratio:.3}",
            if is_url(&o.model) { "plain GET" } else { "sequential read" }
        );
        eprintln!(
            "read {:.0} ms, consume {:.0} ms, wall {:.0} ms: overlap efficiency {overlap:.3}",
            read_total.as_secs_f64() * 1e3,
            consume_total.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e3
        );
        eprintln!(
            "RSS first {} last {} max {} (ring {}; growth after step 1: {} bytes)",
            fmt_bytes(rss_first),
            fmt_bytes(rss_last),
            fmt_bytes(rss_max),
            fmt_bytes((o.slots * o.slot_bytes) as u64),
            rss_last as i64 - rss_first as i64
        );
    }
    Ok(())
}
