//! Command-line values parsed once, for every subcommand: sizes (`512MiB`), backends, file read
//! modes, and the memory options that `run` and the benchmarks share.

use clap::{Args, ValueEnum};
use nibble_core::io::file::FileReadMode;

/// A size with binary units: `4096`, `64k`, `512MiB`, `1.5GiB`.
pub fn size(s: &str) -> Result<u64, String> {
    nibble_core::plan::parse_size(s).map_err(|e| e.to_string())
}

/// Which backend runs the ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum BackendArg {
    /// CUDA when a driver and device are present, then a wgpu adapter that is a real GPU, then
    /// the optimized CPU backend.
    #[default]
    Auto,
    /// The optimized CPU backend (all cores, AVX2 where the CPU has it).
    Cpu,
    /// The scalar reference backend (slow; the oracle of the conformance tests).
    #[value(alias = "cpu_ref")]
    CpuRef,
    /// wgpu: Vulkan, Metal, DX12 (Mesa's lavapipe on CPU-only Linux).
    Wgpu,
    /// CUDA (NVIDIA).
    Cuda,
}

/// How local weight files are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum FileModeArg {
    /// `pread` when the files fit in half the available RAM, `pread-dropcache` otherwise.
    #[default]
    Auto,
    /// Positional reads (the page cache keeps what was read).
    Pread,
    /// Positional reads, then the range is dropped from the page cache (stream from disk).
    PreadDropcache,
    /// O_DIRECT reads: the disk's DMA fills the ring, no copy from the page cache (Linux).
    Direct,
    /// A read-only map, copied out and released page by page.
    Mmap,
}

impl From<FileModeArg> for FileReadMode {
    fn from(m: FileModeArg) -> Self {
        match m {
            FileModeArg::Auto => FileReadMode::Auto,
            FileModeArg::Pread => FileReadMode::Pread,
            FileModeArg::PreadDropcache => FileReadMode::PreadDropCache,
            FileModeArg::Direct => FileReadMode::Direct,
            FileModeArg::Mmap => FileReadMode::Mmap,
        }
    }
}

/// Memory of a run: the device budget and the staging ring.
#[derive(Debug, Clone, Args)]
pub struct MemoryArgs {
    /// Device memory for weights, activations and the KV cache: a size, or `auto` (every weight
    /// resident, capped on the CPU backends, whose device memory is host memory, by the host
    /// budget). Weight groups that do not fit stream through the ring every step.
    #[arg(long, value_parser = budget, default_value = "auto", value_name = "SIZE|auto")]
    pub device_budget: Budget,
    /// Host memory the run may use: a size, or `auto` (the memory available to this process:
    /// MemAvailable capped by its cgroup's limit less usage, less a margin of a tenth, at least
    /// 256 MiB). The plan's host peak (the process's own memory, the ring, the loader and
    /// kernel buffers, and on the CPU backends the device memory too) must fit it.
    #[arg(long, value_parser = budget, default_value = "auto", value_name = "SIZE|auto")]
    pub host_budget: Budget,
    /// Staging-ring slots (reads kept in flight), or `auto`: 4, more when a streamed weight
    /// group is larger than the ring (see `--slot-size`).
    #[arg(long, value_parser = count_or_auto, default_value = "auto", value_name = "N|auto")]
    pub slots: OrAuto,
    /// Bytes per ring slot (a larger tensor streams through in pieces), or `auto`: 16 MiB. With
    /// either `auto`, a ring that the largest streamed group would not fit grows to at least
    /// 16 slots of 32 MiB and to hold that group (so that reads run on while groups compute),
    /// up to an eighth of the host budget left after the process, 1 GiB and 256 slots.
    #[arg(long, value_parser = size_or_auto, default_value = "auto", value_name = "SIZE|auto")]
    pub slot_size: OrAuto,
    /// Stream every weight group through the ring each step, whatever the device budget would
    /// keep resident (the lowest-memory plan).
    #[arg(long)]
    pub stream_all: bool,
}

impl MemoryArgs {
    /// What these options ask of core's budget decision.
    pub fn request(&self) -> nibble_core::plan::budget::BudgetRequest {
        nibble_core::plan::budget::BudgetRequest {
            device: self.device_budget.into(),
            host: self.host_budget,
            slots: self.slots.0,
            slot_size: self.slot_size.0,
            stream_all: self.stream_all,
        }
    }
}

/// A memory budget: `auto` (from the machine) or a size (core's, which decides budgets).
pub use nibble_core::plan::budget::Budget;

/// A number given, or `auto` (`None`): nibble decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrAuto(pub Option<u64>);

impl std::fmt::Display for OrAuto {
    /// As the command line takes it: `auto` or the number.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("auto"),
            Some(n) => write!(f, "{n}"),
        }
    }
}

/// `auto` or a count of at least 1.
pub fn count_or_auto(s: &str) -> Result<OrAuto, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(OrAuto(None));
    }
    slot_count(s).map(|n| OrAuto(Some(n as u64)))
}

/// The largest ring slot a flag may ask for.
pub const MAX_SLOT_BYTES: u64 = 4 << 30;

/// The most ring slots a flag may ask for.
pub const MAX_SLOTS: u64 = 4096;

/// A ring slot's size: 4 KiB (the ring's smallest) to 4 GiB.
pub fn slot_size(s: &str) -> Result<usize, String> {
    let least = nibble_core::stream::ring::MIN_SLOT_BYTES;
    match size(s)? {
        b if b < least => Err(format!("a ring slot takes at least {least} bytes")),
        b if b > MAX_SLOT_BYTES => Err(format!(
            "a ring slot takes at most {MAX_SLOT_BYTES} bytes (4 GiB)"
        )),
        b => usize::try_from(b).map_err(|_| format!("{s} is more than this machine can address")),
    }
}

/// The largest synthetic model `synth` writes: 4 TiB (beyond any real 4-bit model; a size
/// past it is a typo, and synth's own tensor list grows with it before the disk is asked).
pub const MAX_SYNTH_BYTES: u64 = 4 << 40;

/// A synthetic model's size: 1 MiB to [`MAX_SYNTH_BYTES`].
pub fn synth_size(s: &str) -> Result<u64, String> {
    match size(s)? {
        b if b < 1 << 20 => Err("a synthetic model takes at least 1 MiB".into()),
        b if b > MAX_SYNTH_BYTES => Err("a synthetic model takes at most 4 TiB".into()),
        b => Ok(b),
    }
}

/// A count of ring slots: 1 to [`MAX_SLOTS`].
pub fn slot_count(s: &str) -> Result<usize, String> {
    match s.parse::<u64>() {
        Ok(n) if (1..=MAX_SLOTS).contains(&n) => Ok(n as usize),
        Ok(_) => Err(format!("{s}: 1 to {MAX_SLOTS} slots")),
        Err(e) => Err(format!("{s}: {e}")),
    }
}

/// Reader threads: 1 to 64.
pub fn readers(s: &str) -> Result<usize, String> {
    let most = nibble_core::io::source::MAX_READERS;
    match s.parse::<usize>() {
        Ok(n) if (1..=most).contains(&n) => Ok(n),
        Ok(_) => Err(format!("{s}: 1 to {most} readers")),
        Err(e) => Err(format!("{s}: {e}")),
    }
}

/// `auto` or a slot size ([`slot_size`]).
pub fn size_or_auto(s: &str) -> Result<OrAuto, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(OrAuto(None));
    }
    slot_size(s).map(|b| OrAuto(Some(b as u64)))
}

/// `auto` or a size.
pub fn budget(s: &str) -> Result<Budget, String> {
    if s.eq_ignore_ascii_case("auto") {
        Ok(Budget::Auto)
    } else {
        size(s).map(Budget::Bytes)
    }
}

/// A request body limit: 1 KiB to 1 GiB (bodies are held in memory while parsed).
pub fn body_size(s: &str) -> Result<u64, String> {
    match size(s)? {
        b if (1 << 10..=1 << 30).contains(&b) => Ok(b),
        _ => Err(format!("{s}: a body limit of 1KiB to 1GiB")),
    }
}

/// The command-line spelling of a value of a value enum (for a child process's arguments).
pub fn value_name<T: ValueEnum>(v: T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// Denoising steps: 1 to the schedulers' limit (100,000), for every subcommand that denoises.
pub fn steps(s: &str) -> Result<usize, String> {
    let max = nibble_core::models::scheduler::MAX_STEPS;
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s}: denoising steps are a whole number from 1 to {max}"
        )),
    }
}

/// A finite number (NaN and infinities are refused where the value is read).
pub fn finite(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("{s}: {e}"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{s} is not a finite number"))
    }
}

/// A finite number as an f32.
pub fn finite_f32(s: &str) -> Result<f32, String> {
    let v = finite(s)?;
    let f = v as f32;
    if f.is_finite() {
        Ok(f)
    } else {
        Err(format!("{s} is out of range"))
    }
}

/// `--lora [NAME=]FILE_OR_FOLDER[:SCALE]`.
pub fn lora(s: &str) -> Result<nibble_core::models::lora::AdapterArg, String> {
    nibble_core::models::lora::AdapterArg::parse(s).map_err(|e| e.to_string())
}

/// LoRA adapters applied beside the model's linears (4-bit weights untouched).
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "LoRA adapters")]
pub struct LoraArgs {
    /// A LoRA adapter: a peft folder (adapter_config.json + adapter_model.safetensors), a
    /// diffusers or kohya .safetensors file, or an http(s) URL of either, with an optional scale
    /// after a colon (`style.safetensors:0.8`). Repeatable: the adapters' paths are summed in
    /// order. Its tensors stay resident; the base weights stream as without it.
    #[arg(long = "lora", value_name = "FILE_OR_FOLDER[:SCALE]", value_parser = lora)]
    pub lora: Vec<nibble_core::models::lora::AdapterArg>,
    /// Skip (and count) an adapter's keys for models the run does not adapt (a Flux LoRA's
    /// text-encoder keys) instead of refusing the file.
    #[arg(long)]
    pub lora_ignore_unmatched: bool,
}

impl LoraArgs {
    /// `model` with the adapters bound (itself without any), after a line per adapter on stderr
    /// unless `quiet`: what it adapts, its scale and the bytes it keeps resident.
    pub fn bind(
        &self,
        model: &nibble_core::io::model::ModelIndex,
        target: nibble_core::models::lora::Target<'_>,
        mode: FileReadMode,
        quiet: bool,
    ) -> anyhow::Result<nibble_core::io::model::ModelIndex> {
        Ok(self
            .bind_pipeline(&[(model, target)], mode, quiet)?
            .remove(0))
    }

    /// [`LoraArgs::bind`] over the models of a pipeline, each with its target.
    pub fn bind_pipeline(
        &self,
        components: &[(
            &nibble_core::io::model::ModelIndex,
            nibble_core::models::lora::Target<'_>,
        )],
        mode: FileReadMode,
        quiet: bool,
    ) -> anyhow::Result<Vec<nibble_core::io::model::ModelIndex>> {
        use anyhow::Context;
        if self.lora.is_empty() {
            return Ok(components.iter().map(|(m, _)| (*m).clone()).collect());
        }
        let files = nibble_core::models::lora::open_all(&self.lora, mode)?;
        let (bound, report) = nibble_core::models::lora::bind_pipeline(
            components,
            &files,
            self.lora_ignore_unmatched,
        )
        .context("binding the LoRA adapters")?;
        if !quiet {
            for (r, f) in report.iter().zip(&files) {
                let mut notes = String::new();
                if r.unmatched > 0 {
                    notes.push_str(&format!(
                        ", {} modules of other models skipped",
                        r.unmatched
                    ));
                }
                if r.dropped > 0 {
                    notes.push_str(&format!(
                        ", {} norm-layer deltas dropped (as diffusers drops them)",
                        r.dropped
                    ));
                }
                eprintln!(
                    "lora {}: {} linears, scale {}, {} resident{notes}",
                    r.name,
                    r.modules,
                    f.arg.scale,
                    nibble_core::plan::fmt_bytes(r.bytes),
                );
            }
        }
        Ok(bound)
    }
}
