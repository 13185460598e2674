//! `nibble`: run 4-bit (bitsandbytes NF4/FP4) models that do not fit, streamed layer by layer.

mod args;
mod backends;
mod cmd;
mod output;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// nibble runs 4-bit (bitsandbytes NF4/FP4) transformer models that do not fit in GPU memory or
/// in RAM: each step streams the weights it needs from disk or HTTP through a fixed staging
/// ring, on CUDA, wgpu (Vulkan/Metal/DX12, WebGPU in the browser) or the CPU. Memory is planned
/// before the first byte is read, printed, and never grows.
#[derive(Debug, Parser)]
#[command(name = "nibble", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a model: generate text with a Llama-family decoder, denoise with a Flux-style DiT,
    /// embed with a BERT encoder (the kind is read from config.json), or make a picture with a
    /// diffusers Flux pipeline folder (model_index.json), streamed through the ring.
    Run(Box<cmd::run::RunArgs>),
    /// Print the memory plan of a run without reading a weight byte: the budgets and where they
    /// came from, each phase's tiers, the smallest device budget that would run (takes
    /// `nibble run`'s options).
    Plan(Box<cmd::run::RunArgs>),
    /// The main job on a built-in default: a synthetic diffusers Flux folder (random weights, a
    /// ~1.5 GiB NF4 transformer) turns a prompt into a PNG in a 512 MiB device budget, 50 steps
    /// streamed through a 4 x 32 MiB ring; per-step figures, a summary and a chart.
    Demo(cmd::demo::DemoArgs),
    /// List a model's tensors, its 4-bit weights with their quant state, totals and config.
    Inspect(cmd::inspect::InspectArgs),
    /// Dequantize 4-bit weights to F32 under their base names.
    Dequant(cmd::quant::DequantArgs),
    /// Quantize the 2-D float weights of a model to bitsandbytes 4-bit; copy the rest unchanged.
    Quantize(cmd::quant::QuantizeArgs),
    /// Convert a llama.cpp GGUF (llama, qwen2) to a transformers NF4 model folder: weights,
    /// config.json, tokenizer.json, tokenizer_config.json (chat template).
    Convert(cmd::quant::ConvertArgs),
    /// Serve a folder over HTTP with byte ranges, ETag and CORS (models for HTTP streaming, the
    /// browser demo), or with --model a language model or encoder over an OpenAI-compatible API
    /// (concurrent requests decoded together).
    Serve(cmd::serve::ServeArgs),
    /// Write a deterministic synthetic NF4 model in the real transformers / diffusers layout.
    Synth(cmd::synth::SynthArgs),
    /// Benchmarks: kernels, offloading, the weight stream.
    Bench {
        #[command(subcommand)]
        kind: cmd::bench::BenchCommand,
    },
    /// Internal (`--backend auto`): print the wgpu adapter as one JSON line, from a process of
    /// its own so that a software renderer's memory does not stay in the caller's.
    #[command(hide = true)]
    ProbeWgpu,
}

/// Mesa's Vulkan drivers complain on stderr when XDG_RUNTIME_DIR is unset (headless machines):
/// give them a private one, before any thread starts. The folder is new (created, never
/// reused: another user cannot have made it first), private (0700), and removed when the
/// returned guard drops at the end of `main`.
fn quiet_mesa() -> Option<XdgDir> {
    if std::env::var_os("XDG_RUNTIME_DIR").is_some() {
        return None;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    for k in 0..16u32 {
        let dir = std::env::temp_dir().join(format!(
            "nibble-xdg-{}-{:08x}",
            std::process::id(),
            nanos.wrapping_add(k.wrapping_mul(0x9e37_79b9))
        ));
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            b.mode(0o700);
        }
        match b.create(&dir) {
            Ok(()) => {
                std::env::set_var("XDG_RUNTIME_DIR", &dir);
                #[cfg(unix)]
                remove_on_signals(&dir);
                return Some(XdgDir(dir));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(_) => return None,
        }
    }
    None
}

/// The folder's path for [`on_signal`], set once before any handler is installed.
#[cfg(unix)]
static XDG_PATH: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();

/// A process ended by SIGTERM, SIGINT or SIGHUP (how services and terminals stop it) does not
/// run `main`'s drops: remove the (empty) folder in the handler, then die of the signal as
/// before. A later handler (the server's for SIGINT and SIGTERM) replaces this one and ends
/// `main` normally instead.
#[cfg(unix)]
fn remove_on_signals(dir: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return;
    };
    if XDG_PATH.set(c).is_err() {
        return;
    }
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: `on_signal` only makes async-signal-safe calls (rmdir, signal, raise).
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    if let Some(p) = XDG_PATH.get() {
        // SAFETY: a NUL-terminated path set before the handler was installed.
        unsafe { libc::rmdir(p.as_ptr()) };
    }
    // SAFETY: restoring the default action and raising the signal again ends the process as
    // the signal would have.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// The private XDG_RUNTIME_DIR of this process, removed on drop.
struct XdgDir(std::path::PathBuf);

impl Drop for XdgDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn probe_wgpu() -> anyhow::Result<()> {
    let info = nibble_wgpu::WgpuBackend::probe()?;
    output::write_stdout(&format!(
        "{}\n",
        serde_json::json!({"name": info.name, "backend": format!("{:?}", info.backend),
                           "software": info.device_type == nibble_wgpu::wgpu::DeviceType::Cpu})
    ))
}

fn main() -> ExitCode {
    let _xdg = quiet_mesa();
    // A panic inside a third-party parser behind nibble's panic boundary becomes an error that
    // names the file: the default hook's message would only repeat it.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !nibble_core::error::in_guarded_call() {
            hook(info)
        }
    }));
    // A wrong argument is an error like any other (exit 1, one message); --help and --version
    // print and succeed.
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let result = match &cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Plan(a) => {
            let mut a = a.clone();
            a.plan_only = true;
            cmd::run::run(&a)
        }
        Command::Demo(a) => cmd::demo::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Dequant(a) => cmd::quant::dequant(a),
        Command::Quantize(a) => cmd::quant::quantize(a),
        Command::Convert(a) => cmd::quant::convert(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Bench { kind } => cmd::bench::run(kind),
        Command::ProbeWgpu => probe_wgpu(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, no backtrace: the error names file, tensor and offset.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
