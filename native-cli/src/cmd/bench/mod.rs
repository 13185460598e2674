//! `nibble bench`: kernels on one backend, a DiT denoised three ways (resident, streamed, the
//! naive offloader), and the weight stream alone.

mod kernels;
mod offload;
mod roofline;
mod stream;

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::args::{
    budget, count_or_auto, size, size_or_auto, BackendArg, Budget, FileModeArg, OrAuto,
};

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Each kernel at realistic shapes (NF4 linear GEMV and tiled, attention, norms) on one
    /// backend: time per call, GB/s, GFLOP/s; on CUDA also pinned H2D, device copy, cuBLAS bf16
    /// and a GEMV beyond L2 as references.
    Kernels(KernelsArgs),
    /// A DiT's denoising three ways, each in its own process: resident (if it fits), streamed
    /// through nibble's ring, and the naive offloader (a fresh buffer per block per step); step
    /// time and RSS per step, the streamed run's overlap, a chart.
    Offload(OffloadArgs),
    /// Stream every weight S times through the ring into a simulated consumer (or a backend's
    /// weight pool), against a plain read of the same bytes.
    Stream(StreamArgs),
}

/// Runs one benchmark.
pub fn run(c: &BenchCommand) -> anyhow::Result<()> {
    match c {
        BenchCommand::Kernels(a) => kernels::run(a),
        BenchCommand::Offload(a) => offload::run(a),
        BenchCommand::Stream(a) => stream::run(a),
    }
}

/// Options of `nibble bench kernels`.
#[derive(Debug, Clone, Args)]
pub struct KernelsArgs {
    /// The backend measured (cpu, cpu-ref, wgpu or cuda).
    #[arg(long, value_enum, default_value_t = BackendArg::Wgpu)]
    pub backend: BackendArg,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// 512 tokens instead of 4096 (for slow backends such as cpu-ref).
    #[arg(long)]
    pub quick: bool,
}

/// Options of `nibble bench offload`.
#[derive(Debug, Clone, Args)]
pub struct OffloadArgs {
    /// DiT folder or URL.
    #[arg(long)]
    pub model: String,
    /// Steps per mode (1 to 100000).
    #[arg(long, default_value_t = 10, value_parser = crate::args::steps)]
    pub steps: usize,
    /// Device budget of the streamed and naive modes: a size, or `auto` (as `nibble run`).
    #[arg(long, value_parser = budget, default_value = "512MiB", value_name = "SIZE|auto")]
    pub device_budget: Budget,
    /// Ring slots, or `auto` (as `nibble run --slots`).
    #[arg(long, value_parser = count_or_auto, default_value = "4", value_name = "N|auto")]
    pub slots: OrAuto,
    /// Bytes per ring slot, or `auto` (as `nibble run --slot-size`).
    #[arg(long, value_parser = size_or_auto, default_value = "32MiB", value_name = "SIZE|auto")]
    pub slot_size: OrAuto,
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t)]
    pub backend: BackendArg,
    /// Latent grid height in tokens.
    #[arg(long, default_value_t = 8)]
    pub height: usize,
    /// Latent grid width in tokens.
    #[arg(long, default_value_t = 8)]
    pub width: usize,
    /// Text tokens.
    #[arg(long, default_value_t = 16)]
    pub text_len: usize,
    /// Run the resident mode only when the model needs at most this much (default 60% of the
    /// available memory).
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub resident_limit: Option<u64>,
    /// How local files are read (direct: O_DIRECT, the disk's DMA fills the ring).
    #[arg(long, value_enum, default_value_t)]
    pub file_mode: FileModeArg,
    /// Internal: run one mode (resident, streamed, naive) and print its JSON.
    #[arg(long, hide = true)]
    pub mode: Option<String>,
    /// Path stem of the chart (.svg and .png).
    #[arg(long)]
    pub chart: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Options of `nibble bench stream`.
#[derive(Debug, Clone, Args)]
pub struct StreamArgs {
    /// Model path or URL.
    #[arg(long)]
    pub model: String,
    /// Ring slots (1 to 4096).
    #[arg(long, default_value_t = 4, value_parser = crate::args::slot_count)]
    pub slots: usize,
    /// Bytes per slot (4 KiB to 4 GiB).
    #[arg(long = "slot-size", value_parser = crate::args::slot_size, default_value = "16MiB", value_name = "SIZE")]
    pub slot_bytes: usize,
    /// Passes over all weights (1 to 100000).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub steps: u64,
    /// Simulated compute per MiB consumed, in ms (0 to 10000).
    #[arg(long, default_value_t = 0.0, value_parser = consume_ms)]
    pub consume_ms_per_mib: f64,
    /// Reader threads (parallel connections for a URL; 1 to 64).
    #[arg(long, default_value_t = 2, value_parser = crate::args::readers)]
    pub readers: usize,
    /// How local files are read.
    #[arg(long, value_enum, default_value_t)]
    pub file_mode: FileModeArg,
    /// Upload each chunk to this backend's weight pool (cpu, wgpu, cuda; ring slots from the
    /// backend, pinned for CUDA) instead of the simulated consumer.
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Milliseconds of simulated compute per MiB: finite, 0 to 10000.
fn consume_ms(s: &str) -> Result<f64, String> {
    let v = crate::args::finite(s)?;
    if (0.0..=10_000.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s}: between 0 and 10000 ms per MiB"))
    }
}
