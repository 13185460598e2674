//! Memory stays flat while streaming: a 1 GiB synthetic model, 100 steps through 4 x 16 MiB.
//! Asserts bytes (RSS), never time. Alone in this file so that nothing else shares the process.

use std::process::Command;
use std::sync::Arc;

use nibble_core::io::file::{FileReadMode, FileSource};
use nibble_core::io::machine::{peak_rss_bytes, rss_bytes};
use nibble_core::io::model::ModelIndex;
use nibble_core::io::source::{RangeSource, ThreadedSource};
use nibble_core::stream::prefetch::{chunk_schedule, Prefetcher};
use nibble_core::stream::ring::{HostAllocator, StagingRing};

const MIB: u64 = 1 << 20;

#[test]
fn rss_is_flat_over_100_steps_of_a_1gib_model() {
    let dir = tempfile::tempdir().expect("tmp");
    // The model is written by a child process, so this process's peak is the streaming alone.
    let st = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args([
            "synth", "--arch", "llama", "--size", "1GiB", "--seed", "7", "-o",
        ])
        .arg(dir.path())
        .status()
        .expect("synth");
    assert!(st.success());
    let model = ModelIndex::open(dir.path()).expect("open");
    assert!(
        model.file_bytes() > 900 * MIB,
        "about 1 GiB: {}",
        model.file_bytes()
    );
    let paths: Vec<std::path::PathBuf> = model
        .source()
        .files()
        .iter()
        .map(|f| f.name.clone().into())
        .collect();
    let source: Arc<dyn RangeSource> =
        Arc::new(FileSource::open(&paths, FileReadMode::Pread).expect("src"));
    let tensors: Vec<_> = model.tensors().cloned().collect();
    let groups: Vec<(usize, Vec<_>)> = (0..model.shards.len())
        .map(|s| {
            (
                s,
                tensors.iter().filter(|t| t.shard == s).cloned().collect(),
            )
        })
        .collect();
    let (slots, slot) = (4usize, 16 * MIB as usize);
    let chunks = chunk_schedule(groups.iter().map(|(g, t)| (*g, t.as_slice())), slot);
    let ring = StagingRing::new(slots, slot, &HostAllocator).expect("ring");
    let mut pf =
        Prefetcher::new(ThreadedSource::new(source, 2), ring, chunks, Some(100)).expect("pf");
    let mut rss = Vec::with_capacity(100);
    let mut max_rss = 0;
    let mut sink = 0u64;
    while let Some(c) = pf.next_chunk().expect("chunk") {
        sink = sink.wrapping_add(
            c.bytes()
                .iter()
                .step_by(4096)
                .map(|&b| b as u64)
                .sum::<u64>(),
        );
        drop(c);
        let now = rss_bytes().expect("RSS is readable on Linux");
        max_rss = max_rss.max(now);
        if pf.take_step_stats().is_some() {
            rss.push(now);
        }
    }
    std::hint::black_box(sink);
    assert_eq!(rss.len(), 100);
    let growth = rss[99] as i64 - rss[1] as i64;
    let ring_bytes = slots as u64 * slot as u64;
    let peak = peak_rss_bytes().expect("VmHWM").max(max_rss);
    println!(
        "RSS after step 2: {} bytes, after step 100: {} bytes, growth {growth} bytes, peak {} bytes (ring {ring_bytes})",
        rss[1], rss[99], peak
    );
    assert!(
        growth <= MIB as i64,
        "RSS grew by {growth} bytes between step 2 and step 100"
    );
    assert!(
        peak < ring_bytes + 64 * MIB,
        "peak RSS {peak} is not under ring + 64 MiB"
    );
}
