//! The streaming pipeline: chunking through a small ring, order, statistics, faults.

use std::collections::HashMap;
use std::sync::Arc;

use nibble_core::io::file::{FileReadMode, FileSource};
use nibble_core::io::model::ModelIndex;
use nibble_core::io::source::{RangeSource, ThreadedSource};
use nibble_core::stream::prefetch::{chunk_schedule, Prefetcher};
use nibble_core::stream::ring::{HostAllocator, StagingRing};
use nibble_tests::build::*;
use nibble_tests::http_server::{Fault, TestServer};

fn model(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("m.safetensors");
    build_file(
        &p,
        &[
            f32_entry("a.weight", &[64, 100], &random_values(6400, 1)),
            f32_entry("a.bias", &[64], &random_values(64, 2)),
            (
                "b.codes".into(),
                "U8".into(),
                vec![10_001],
                (0..10_001).map(|i| (i % 253) as u8).collect(),
            ),
            f32_entry("c.weight", &[3], &random_values(3, 3)),
        ],
    );
    p
}

fn stream_all(
    source: Arc<dyn RangeSource>,
    m: &ModelIndex,
    slots: usize,
    slot: usize,
    steps: u64,
) -> Vec<Vec<u8>> {
    let tensors: Vec<_> = m.tensors().cloned().collect();
    let chunks = chunk_schedule([(0usize, tensors.as_slice())], slot);
    let ring = StagingRing::new(slots, slot, &HostAllocator).expect("ring");
    let mut pf =
        Prefetcher::new(ThreadedSource::new(source, 2), ring, chunks, Some(steps)).expect("pf");
    let mut per_step = vec![Vec::new(); steps as usize];
    let mut stats = Vec::new();
    while let Some(c) = pf.next_chunk().expect("chunk") {
        let step = (c.seq / pf.chunks_per_step() as u64) as usize;
        per_step[step].extend_from_slice(c.bytes());
        drop(c);
        stats.extend(pf.take_step_stats());
    }
    assert_eq!(stats.len(), steps as usize, "one stats record per step");
    let step_bytes: u64 = tensors.iter().map(|t| t.len).sum();
    assert!(stats.iter().all(|s| s.bytes == step_bytes));
    per_step
}

fn file_data(m: &ModelIndex, file: &[u8]) -> Vec<u8> {
    m.tensors()
        .flat_map(|t| file[t.offset as usize..t.end() as usize].to_vec())
        .collect()
}

#[test]
fn tensors_larger_than_a_slot_stream_through_in_chunks() {
    let d = tempfile::tempdir().expect("tmp");
    let p = model(d.path());
    let m = ModelIndex::open(&p).expect("open");
    let file = std::fs::read(&p).expect("read");
    let want = file_data(&m, &file);
    for mode in [
        FileReadMode::Pread,
        FileReadMode::PreadDropCache,
        FileReadMode::Direct,
        FileReadMode::Mmap,
    ] {
        let src = Arc::new(FileSource::open(std::slice::from_ref(&p), mode).expect("source"));
        // 25600-byte and 10001-byte tensors through 4096-byte slots.
        for (slots, slot) in [(2, 4096), (3, 8192), (1, 4096)] {
            let steps = stream_all(src.clone(), &m, slots, slot, 3);
            for s in &steps {
                assert_eq!(
                    s, &want,
                    "{mode:?} {slots}x{slot}: bytes arrive complete and in order"
                );
            }
        }
    }
}

#[test]
fn chunk_schedule_splits_at_slot_size() {
    let d = tempfile::tempdir().expect("tmp");
    let m = ModelIndex::open(&model(d.path())).expect("open");
    let tensors: Vec<_> = m.tensors().cloned().collect();
    let chunks = chunk_schedule([(7usize, tensors.as_slice())], 4096);
    assert!(chunks.iter().all(|c| c.len <= 4096 && c.group == 7));
    let a: Vec<_> = chunks
        .iter()
        .flat_map(|c| c.parts.iter())
        .filter(|p| p.tensor == "a.weight")
        .collect();
    assert_eq!(a.len(), 7, "25600 bytes in 4096-byte pieces");
    assert_eq!(a.iter().map(|p| p.len).sum::<usize>(), 25600);
    assert_eq!(a[6].tensor_offset, 6 * 4096);
    // Contiguous neighbours share reads, and every chunk is one contiguous file range.
    assert!(chunks.iter().any(|c| c.parts.len() > 1));
    for c in &chunks {
        assert_eq!(c.parts.iter().map(|p| p.len).sum::<usize>(), c.len);
        for p in &c.parts {
            let t = tensors.iter().find(|t| t.name == p.tensor).expect("tensor");
            assert_eq!(c.offset + p.chunk_offset as u64, t.offset + p.tensor_offset);
        }
    }
    let total: usize = chunks.iter().map(|c| c.len).sum();
    assert_eq!(total as u64, tensors.iter().map(|t| t.len).sum::<u64>());
}

#[test]
fn file_truncated_while_streaming_is_an_error_naming_the_tensor() {
    let d = tempfile::tempdir().expect("tmp");
    let p = model(d.path());
    let m = ModelIndex::open(&p).expect("open");
    let src: Arc<dyn RangeSource> =
        Arc::new(FileSource::open(std::slice::from_ref(&p), FileReadMode::Pread).expect("src"));
    let len = std::fs::metadata(&p).expect("meta").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .expect("open rw")
        .set_len(len - 100)
        .expect("truncate");
    let tensors: Vec<_> = m.tensors().cloned().collect();
    let ring = StagingRing::new(2, 4096, &HostAllocator).expect("ring");
    let mut pf = Prefetcher::new(
        ThreadedSource::new(src, 1),
        ring,
        chunk_schedule([(0, tensors.as_slice())], 4096),
        Some(1),
    )
    .expect("pf");
    let err = loop {
        match pf.next_chunk() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("a truncated file streamed without error"),
            Err(e) => break e,
        }
    };
    let msg = err.to_string();
    assert!(
        msg.contains("short read") && msg.contains("m.safetensors"),
        "{msg}"
    );
}

#[test]
fn consumer_holding_every_slot_gets_an_error_not_a_deadlock() {
    let d = tempfile::tempdir().expect("tmp");
    let p = model(d.path());
    let m = ModelIndex::open(&p).expect("open");
    let tensors: Vec<_> = m.tensors().cloned().collect();
    let ring = StagingRing::new(2, 4096, &HostAllocator).expect("ring");
    let mut pf = Prefetcher::new(
        ThreadedSource::new(m.source(), 1),
        ring,
        chunk_schedule([(0, tensors.as_slice())], 4096),
        None,
    )
    .expect("pf");
    let a = pf.next_chunk().expect("1").expect("chunk");
    let b = pf.next_chunk().expect("2").expect("chunk");
    let e = pf.next_chunk().expect_err("no slot left");
    assert!(e.to_string().contains("held by the consumer"), "{e}");
    drop((a, b));
    assert!(pf.next_chunk().expect("slots back").is_some());
}

#[test]
fn ring_and_chunk_size_errors() {
    assert!(StagingRing::new(4, 0, &HostAllocator)
        .expect_err("slot size 0")
        .to_string()
        .contains("at least one slot"));
    let e = StagingRing::new(4, 1000, &HostAllocator).expect_err("ring smaller than one chunk");
    assert!(e.to_string().contains("smaller than one chunk"), "{e}");
    let d = tempfile::tempdir().expect("tmp");
    let m = ModelIndex::open(&model(d.path())).expect("open");
    let tensors: Vec<_> = m.tensors().cloned().collect();
    let ring = StagingRing::new(2, 4096, &HostAllocator).expect("ring");
    let e = Prefetcher::new(
        ThreadedSource::new(m.source(), 1),
        ring,
        chunk_schedule([(0, tensors.as_slice())], 8192),
        Some(1),
    )
    .expect_err("chunks larger than a slot");
    assert!(e.to_string().contains("larger than a ring slot"), "{e}");
}

/// Counts the bytes read through it.
struct Counting {
    inner: Arc<dyn RangeSource>,
    bytes: std::sync::atomic::AtomicU64,
}

impl RangeSource for Counting {
    fn files(&self) -> &[nibble_core::io::source::SourceFile] {
        self.inner.files()
    }
    fn read_exact_at(
        &self,
        file: usize,
        offset: u64,
        buf: &mut [u8],
        what: &str,
    ) -> nibble_core::Result<()> {
        self.bytes
            .fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.inner.read_exact_at(file, offset, buf, what)
    }
}

#[test]
fn impossible_budget_is_refused_before_any_io_with_the_exact_smallest_budget() {
    use nibble_core::backend::cpu_ref::CpuRefBackend;
    use nibble_core::exec::{ExecOptions, Executor};
    use nibble_core::graph::{Graph, OpKind, ValueInfo};
    use nibble_core::io::model::{read_header, Shard};
    use nibble_core::plan::Budgets;
    let d = tempfile::tempdir().expect("tmp");
    let p = model(d.path());
    let counting = Arc::new(Counting {
        inner: Arc::new(
            FileSource::open(std::slice::from_ref(&p), FileReadMode::Pread).expect("src"),
        ),
        bytes: Default::default(),
    });
    let shard = Shard {
        name: "m.safetensors".into(),
        header: read_header(&p).expect("header"),
    };
    let m = ModelIndex::from_parts(
        p.display().to_string(),
        vec![shard],
        None,
        counting.clone(),
        None,
    )
    .expect("index");
    let graph = || {
        let mut g = Graph::new();
        let x = g.input(ValueInfo::f32(&[2, 100]));
        let grp = g.group("a");
        let w = g.dense_weight(grp, "a.weight", &[64, 100]);
        let b = g.dense_weight(grp, "a.bias", &[64]);
        let y = g
            .op(OpKind::Linear { bias: true }, &[x, w, b], None)
            .expect("linear");
        g.output(y);
        g
    };
    let opts = |device_bytes| ExecOptions {
        budgets: Budgets {
            device_bytes,
            ring_slots: 2,
            slot_bytes: 4096,
            host_tier_bytes: 0,
        },
        readers: 1,
        stream_all: false,
        naive: false,
    };
    let e = Executor::new(graph(), &m, CpuRefBackend::new(), opts(1024)).expect_err("cannot fit");
    let msg = e.to_string();
    assert_eq!(
        counting.bytes.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "nothing was read before the refusal"
    );
    // The smallest budget the error names is exact: it runs, and one byte less does not.
    let min =
        nibble_core::plan::min_device_bytes(&graph(), &m, &mut CpuRefBackend::new()).expect("min");
    assert!(
        msg.contains(&format!(
            "--device-budget {}",
            nibble_core::plan::fmt_bytes(min)
        )),
        "{msg}"
    );
    Executor::new(graph(), &m, CpuRefBackend::new(), opts(min - 1)).expect_err("one byte short");
    let ex = Executor::new(graph(), &m, CpuRefBackend::new(), opts(min)).expect("the named budget");
    assert_eq!(ex.plan().peak_device_bytes, min);
}

#[test]
fn streaming_over_http_delivers_the_same_bytes() {
    let d = tempfile::tempdir().expect("tmp");
    let p = model(d.path());
    let file = std::fs::read(&p).expect("read");
    let srv = TestServer::start(
        HashMap::from([("m.safetensors".to_string(), file.clone())]),
        Fault::None,
    );
    let m = ModelIndex::open_url(&format!("{}/m.safetensors", srv.base), Default::default())
        .expect("open");
    let want = file_data(&m, &file);
    let opened = srv.stats().body_bytes;
    for s in stream_all(m.source(), &m, 3, 4096, 2) {
        assert_eq!(s, want);
    }
    let st = srv.stats();
    assert_eq!(st.full_gets, 0, "no request was a full-file GET");
    assert_eq!(
        st.body_bytes - opened,
        2 * want.len() as u64,
        "each step fetches exactly the tensors' bytes"
    );
}
