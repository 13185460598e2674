//! `nibble`: run, inspect and convert 4-bit (bitsandbytes NF4/FP4) models.

mod backends;
mod bench_kernels;
mod bench_offload;
mod bench_stream;
mod chart;
mod demo;
mod inspect;
mod quant_cmds;
mod run;
mod run_dit;
mod run_embed;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// nibble: 4-bit transformer models that do not fit, streamed layer by layer.
#[derive(Debug, Parser)]
#[command(name = "nibble", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process; boxing the large `run` variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// List a model's tensors, its 4-bit weights with their quant state, totals and config.
    Inspect {
        /// A `.safetensors` file, a model folder (config.json + one file or shards), or an
        /// http(s) URL of either (only headers are fetched).
        path: String,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Also fetch each 4-bit weight's quant state (small tensors) when PATH is a URL; local
        /// models always show it.
        #[arg(long)]
        quant_state: bool,
    },
    /// Dequantize 4-bit weights to F32 under their base names.
    Dequant {
        /// A `.safetensors` file, a model folder, or a URL of either.
        path: String,
        /// A 4-bit weight to dequantize (its base name, e.g. `model.layers.0.mlp.up_proj.weight`);
        /// repeat for several.
        #[arg(
            long = "tensor",
            required_unless_present = "all",
            conflicts_with = "all"
        )]
        tensors: Vec<String>,
        /// Dequantize every 4-bit weight.
        #[arg(long)]
        all: bool,
        /// Output `.safetensors` file.
        #[arg(short, long)]
        out: PathBuf,
    },
    /// Quantize the 2-D float weights of a model to bitsandbytes 4-bit; copy the rest unchanged.
    Quantize {
        /// A `.safetensors` file, a model folder, or a URL of either.
        input: String,
        /// Output `.safetensors` file.
        #[arg(short, long)]
        out: PathBuf,
        /// 4-bit data type.
        #[arg(long = "quant", value_enum, default_value_t = quant_cmds::QuantArg::Nf4)]
        quant: quant_cmds::QuantArg,
        /// Elements per absmax block (power of two, 32..4096; transformers uses 64).
        #[arg(long, default_value_t = 64)]
        blocksize: u64,
        /// Quantize absmax to 8 bits too (`bnb_4bit_use_double_quant`).
        #[arg(long)]
        double_quant: bool,
        /// Only tensors whose name matches this regex are quantized.
        #[arg(long, default_value = quant_cmds::DEFAULT_INCLUDE)]
        include: String,
        /// Tensors whose name matches this regex are copied unchanged (default: embeddings and
        /// lm_head, as transformers leaves them; pass --exclude '' to quantize them too).
        #[arg(long, default_value = quant_cmds::DEFAULT_EXCLUDE)]
        exclude: String,
    },
    /// Generate with a Llama-family model (token ids in and out), denoise with a Flux-style DiT
    /// or embed the prompt with a BERT encoder (the kind is read from config.json), streamed
    /// through the ring.
    Run {
        /// Model folder or URL.
        #[arg(long)]
        model: String,
        /// LLM or encoder: prompt text (tokenized with the model's tokenizer.json).
        #[arg(long, conflicts_with = "prompt_ids")]
        prompt: Option<String>,
        /// LLM: send the prompt as a user message through the model's chat template.
        #[arg(long, requires = "prompt")]
        chat: bool,
        /// LLM: prompt token ids, comma separated.
        #[arg(long, value_delimiter = ',')]
        prompt_ids: Vec<u32>,
        /// LLM: keep generating after an end-of-sequence token.
        #[arg(long)]
        ignore_eos: bool,
        /// DiT: denoising steps.
        #[arg(long, default_value_t = 28)]
        steps: usize,
        /// DiT: inputs (hidden_states, encoder_hidden_states, pooled_projections, guidance,
        /// img_ids, txt_ids); random from --seed otherwise.
        #[arg(long)]
        inputs: Option<PathBuf>,
        /// DiT: latent grid height in tokens (random inputs).
        #[arg(long, default_value_t = 4)]
        height: usize,
        /// DiT: latent grid width in tokens (random inputs).
        #[arg(long, default_value_t = 4)]
        width: usize,
        /// DiT: text tokens (random inputs).
        #[arg(long, default_value_t = 8)]
        text_len: usize,
        /// DiT: guidance scale (random inputs).
        #[arg(long, default_value_t = 3.5)]
        guidance: f32,
        /// DiT: static schedule shift (1: none).
        #[arg(long, default_value_t = 1.0)]
        shift: f64,
        /// DiT: resolution-dependent shift, as Flux uses.
        #[arg(long)]
        dynamic_shift: bool,
        /// DiT: write the final latent (`latent`, float32).
        #[arg(long)]
        out: Option<PathBuf>,
        /// DiT: PNG of the final latent's first three channels.
        #[arg(long)]
        preview: Option<PathBuf>,
        /// DiT: write the latent and step index into this folder after every step (atomically).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// DiT: continue from the last complete checkpoint in this folder (its inputs and
        /// schedule; the final latent equals an uninterrupted run's).
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Tokens to generate.
        #[arg(long, default_value_t = 16)]
        max_tokens: usize,
        /// auto (CUDA, then a wgpu GPU adapter, then the CPU), cpu, cpu-ref, wgpu, cuda.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Device memory for weights, activations and the KV cache (default: everything
        /// resident).
        #[arg(long)]
        device_budget: Option<String>,
        /// Ring slots.
        #[arg(long, default_value_t = 4)]
        slots: u64,
        /// Bytes per ring slot.
        #[arg(long, default_value = "16MiB")]
        slot_size: String,
        /// Sampling temperature (0: greedy).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Sample among the k most likely tokens (0: all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Sample among the most likely tokens holding this probability.
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Sampling seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write float32 logits (`logits` [prompt, vocab], `step_logits` [n, vocab]).
        #[arg(long)]
        logits_out: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Time every op and print the slowest op kinds at the end.
        #[arg(long)]
        profile: bool,
        /// How local files are read: auto, pread, pread-dropcache (stream from disk, not the
        /// page cache), direct, mmap.
        #[arg(long, default_value = "auto")]
        file_mode: String,
        /// Stream every weight group through the ring each step, whatever the device budget
        /// would keep resident (the lowest-memory plan).
        #[arg(long)]
        stream_all: bool,
    },
    /// Convert a llama.cpp GGUF (llama, qwen2) to a transformers NF4 model folder: weights,
    /// config.json, tokenizer.json, tokenizer_config.json (chat template).
    Convert {
        /// The `.gguf` file.
        gguf: PathBuf,
        /// Output folder.
        #[arg(short, long)]
        out: PathBuf,
        /// 4-bit data type.
        #[arg(long = "quant", value_enum, default_value_t = quant_cmds::QuantArg::Nf4)]
        quant: quant_cmds::QuantArg,
        /// Quantize absmax to 8 bits too (`bnb_4bit_use_double_quant`).
        #[arg(long)]
        double_quant: bool,
        /// Dtype of the tensors kept unquantized (embeddings, norms, lm_head): bf16 or f16.
        #[arg(long, default_value = "bf16")]
        dtype: String,
    },
    /// The main job on a built-in default: a synthetic text encoder, then 50 denoising steps of
    /// a ~1.5 GiB NF4 Flux-style DiT streamed through a 512 MiB device budget and a 4 x 32 MiB
    /// ring; per-step figures, a summary and a chart of RSS and step time.
    Demo {
        /// Denoising steps.
        #[arg(long, default_value_t = 50)]
        steps: usize,
        /// Latent grid height in tokens.
        #[arg(long, default_value_t = 8)]
        height: usize,
        /// Latent grid width in tokens.
        #[arg(long, default_value_t = 8)]
        width: usize,
        /// Text tokens.
        #[arg(long, default_value_t = 16)]
        text_len: usize,
        /// The prompt.
        #[arg(long, default_value = "a lighthouse on a cliff at dusk, oil on canvas")]
        prompt: String,
        /// Size of the synthetic DiT on disk.
        #[arg(long, default_value = "1800MiB")]
        dit_size: String,
        /// Seed of the models and the noise.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Device memory for each phase.
        #[arg(long, default_value = "512MiB")]
        device_budget: String,
        /// Ring slots.
        #[arg(long, default_value_t = 4)]
        slots: u64,
        /// Bytes per ring slot.
        #[arg(long, default_value = "32MiB")]
        slot_size: String,
        /// auto (CUDA, then a wgpu GPU adapter, then the CPU), cpu, cpu-ref, wgpu, cuda.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Where the chart, latent, preview and per-step figures go.
        #[arg(long, default_value = "nibble-demo")]
        out_dir: PathBuf,
        /// Where the synthetic models are kept (default $NIBBLE_CACHE or ~/.cache/nibble).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
        /// Write the DiT latent and step index here after every step (atomically).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Continue the DiT phase from the checkpoint in this folder.
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Internal (`--backend auto`): print the wgpu adapter as one JSON line, from a process of
    /// its own so that a software renderer's memory does not stay in the caller's.
    #[command(hide = true)]
    ProbeWgpu,
    /// Serve a folder over HTTP with byte ranges, ETag and CORS (models, the browser demo).
    Serve {
        /// The folder to serve; nothing outside it is reachable.
        dir: PathBuf,
        /// Address to listen on (loopback unless told otherwise; port 0 picks a free one).
        #[arg(long, default_value = "127.0.0.1:8080")]
        addr: String,
        /// Also serve DIR at /NAME/ (repeatable), e.g. `--mount models=models` beside the
        /// browser demo's page.
        #[arg(long = "mount", value_name = "NAME=DIR")]
        mounts: Vec<String>,
    },
    /// Write a deterministic synthetic NF4 model in the real transformers / diffusers layout.
    Synth {
        /// `llama` (transformers LlamaForCausalLM) or `dit` (diffusers Flux-style DiT).
        #[arg(long, value_enum)]
        arch: SynthArch,
        /// Approximate size on disk, e.g. 1GiB, 256MiB.
        #[arg(long)]
        size: String,
        /// Output folder.
        #[arg(short, long)]
        out: PathBuf,
        /// Seed of the weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        kind: BenchKind,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SynthArch {
    Llama,
    Dit,
}

#[derive(Debug, Subcommand)]
enum BenchKind {
    /// Each kernel at realistic shapes (NF4 linear GEMV and tiled, attention, norms) on one
    /// backend: time per call, GB/s, GFLOP/s.
    Kernels {
        /// cpu (the optimized CPU backend), cpu-ref, wgpu, or cuda (adds pinned H2D, device copy and
        /// cuBLAS bf16 references and a GEMV beyond L2).
        #[arg(long, default_value = "wgpu")]
        backend: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// 512 tokens instead of 4096 (for slow backends such as cpu_ref).
        #[arg(long)]
        quick: bool,
    },
    /// A DiT's denoising three ways, each in its own process: resident (if it fits), streamed
    /// through nibble's ring, and the naive offloader (a fresh buffer per block per step); step
    /// time and RSS per step, the streamed run's overlap, a chart.
    Offload {
        /// DiT folder or URL.
        #[arg(long)]
        model: String,
        /// Steps per mode.
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Device budget of the streamed and naive modes.
        #[arg(long, default_value = "512MiB")]
        device_budget: String,
        /// Ring slots.
        #[arg(long, default_value_t = 4)]
        slots: u64,
        /// Bytes per ring slot.
        #[arg(long, default_value = "32MiB")]
        slot_size: String,
        /// auto, cpu, cpu-ref, wgpu, cuda.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Latent grid height in tokens.
        #[arg(long, default_value_t = 8)]
        height: usize,
        /// Latent grid width in tokens.
        #[arg(long, default_value_t = 8)]
        width: usize,
        /// Text tokens.
        #[arg(long, default_value_t = 16)]
        text_len: usize,
        /// Run the resident mode only when the model needs at most this much (default 60% of
        /// available memory).
        #[arg(long)]
        resident_limit: Option<String>,
        /// How local files are read: auto, pread, pread-dropcache, direct (O_DIRECT: the disk's
        /// DMA fills the ring, no CPU copy from the page cache), mmap.
        #[arg(long, default_value = "auto")]
        file_mode: String,
        /// Internal: run one mode (resident, streamed, naive) and print its JSON.
        #[arg(long, hide = true)]
        mode: Option<String>,
        /// Path stem of the chart (.svg and .png).
        #[arg(long)]
        chart: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Stream every weight S times through the ring into a simulated consumer, against a plain
    /// read of the same bytes.
    Stream {
        /// Model path or URL.
        #[arg(long)]
        model: String,
        /// Ring slots.
        #[arg(long, default_value_t = 4)]
        slots: usize,
        /// Bytes per slot.
        #[arg(long, default_value = "16MiB")]
        slot_size: String,
        /// Passes over all weights.
        #[arg(long, default_value_t = 3)]
        steps: u64,
        /// Simulated compute per MiB consumed, in ms.
        #[arg(long, default_value_t = 0.0)]
        consume_ms_per_mib: f64,
        /// Reader threads (parallel connections for a URL).
        #[arg(long, default_value_t = 2)]
        readers: usize,
        /// How local files are read: auto, pread, pread-dropcache, direct, mmap.
        #[arg(long, default_value = "auto")]
        file_mode: String,
        /// Upload each chunk to this backend (cpu, wgpu, cuda; ring slots from the backend,
        /// pinned for CUDA) instead of the simulated consumer.
        #[arg(long)]
        backend: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Opens a model by local path or http(s) URL.
pub(crate) fn open_model(arg: &str) -> anyhow::Result<nibble_core::io::model::ModelIndex> {
    open_model_with(arg, "auto")
}

/// Opens a model by local path (read with `file_mode`) or http(s) URL.
pub(crate) fn open_model_with(
    arg: &str,
    file_mode: &str,
) -> anyhow::Result<nibble_core::io::model::ModelIndex> {
    let mode = nibble_core::io::file::FileReadMode::parse(file_mode).ok_or_else(|| {
        anyhow::anyhow!(
            "--file-mode '{file_mode}': expected auto, pread, pread-dropcache, direct or mmap"
        )
    })?;
    Ok(nibble_core::io::model::ModelIndex::open_path_or_url(
        arg, mode,
    )?)
}

fn synth(arch: SynthArch, size: &str, out: &std::path::Path, seed: u64) -> anyhow::Result<()> {
    use nibble_core::plan::{fmt_bytes, parse_size};
    use nibble_core::tooling::synth::{Arch, SynthModel};
    let size = parse_size(size)?;
    let arch = match arch {
        SynthArch::Llama => Arch::Llama,
        SynthArch::Dit => Arch::Dit,
    };
    let m = SynthModel::new(arch, size, seed);
    let total = m.tensor_bytes();
    eprintln!(
        "writing {} of tensors to {}",
        fmt_bytes(total),
        out.display()
    );
    let mut last = 0u64;
    let files = m.write(out, |done, total| {
        if done - last >= 64 << 20 || done == total {
            eprint!(
                "\r  {:>5.1}%  {} / {}",
                done as f64 * 100.0 / total.max(1) as f64,
                fmt_bytes(done),
                fmt_bytes(total)
            );
            last = done;
        }
    })?;
    eprintln!();
    eprintln!(
        "wrote config.json and {} file(s): {}",
        files.len(),
        files.join(", ")
    );
    Ok(())
}

/// Writes to stdout; a closed pipe (`nibble inspect ... | head`) is not an error.
pub(crate) fn write_stdout(s: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Mesa's Vulkan drivers complain on stderr when XDG_RUNTIME_DIR is unset (headless machines):
/// give them a private one, before any thread starts.
fn quiet_mesa() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir().join(format!("nibble-xdg-{}", std::process::id()));
        if std::fs::create_dir_all(&dir).is_ok() {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
            }
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
    }
}

fn main() -> ExitCode {
    quiet_mesa();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect {
            path,
            json,
            quant_state,
        } => inspect::run(&path, json, quant_state),
        Command::ProbeWgpu => (|| {
            let info = nibble_wgpu::WgpuBackend::probe()?;
            write_stdout(&format!(
                "{}\n",
                serde_json::json!({"name": info.name, "backend": format!("{:?}", info.backend),
                                   "software": info.device_type == nibble_wgpu::wgpu::DeviceType::Cpu})
            ))
        })(),
        Command::Serve { dir, addr, mounts } => (|| {
            let mounts = mounts
                .iter()
                .map(|m| serve::parse_mount(m))
                .collect::<anyhow::Result<Vec<_>>>()?;
            serve::run(&dir, &mounts, &addr)
        })(),
        Command::Demo {
            steps,
            height,
            width,
            text_len,
            prompt,
            dit_size,
            seed,
            device_budget,
            slots,
            slot_size,
            backend,
            out_dir,
            cache_dir,
            checkpoint,
            resume,
            json,
        } => demo::run(&demo::DemoOptions {
            steps,
            height,
            width,
            text_len,
            prompt,
            dit_size,
            seed,
            device_budget,
            slots,
            slot_size,
            backend,
            out_dir,
            cache_dir,
            checkpoint,
            resume,
            json,
        }),
        Command::Convert {
            gguf,
            out,
            quant,
            double_quant,
            dtype,
        } => quant_cmds::convert(&gguf, &out, quant, double_quant, &dtype),
        Command::Run {
            model,
            prompt,
            chat,
            prompt_ids,
            ignore_eos,
            steps,
            inputs,
            height,
            width,
            text_len,
            guidance,
            shift,
            dynamic_shift,
            out,
            preview,
            checkpoint,
            resume,
            max_tokens,
            backend,
            device_budget,
            slots,
            slot_size,
            temperature,
            top_k,
            top_p,
            seed,
            logits_out,
            json,
            profile,
            file_mode,
            stream_all,
        } => run::run(&run::RunOptions {
            model,
            prompt,
            chat,
            prompt_ids,
            max_tokens,
            ignore_eos,
            backend,
            device_budget,
            slots,
            slot_size,
            temperature,
            top_k,
            top_p,
            seed,
            logits_out,
            json,
            profile,
            file_mode,
            stream_all,
            dit: run_dit::DitRun {
                steps,
                inputs,
                seed,
                height,
                width,
                text_len,
                guidance,
                shift,
                dynamic_shift,
                out,
                preview,
                checkpoint,
                resume,
            },
        }),
        Command::Synth {
            arch,
            size,
            out,
            seed,
        } => synth(arch, &size, &out, seed),
        Command::Bench {
            kind:
                BenchKind::Kernels {
                    backend,
                    json,
                    quick,
                },
        } => bench_kernels::run(&backend, json, quick),
        Command::Bench {
            kind:
                BenchKind::Offload {
                    model,
                    steps,
                    device_budget,
                    slots,
                    slot_size,
                    backend,
                    height,
                    width,
                    text_len,
                    resident_limit,
                    file_mode,
                    mode,
                    chart,
                    json,
                },
        } => bench_offload::run(&bench_offload::OffloadBench {
            model,
            steps,
            device_budget,
            slots,
            slot_size,
            backend,
            height,
            width,
            text_len,
            resident_limit,
            file_mode,
            mode,
            chart,
            json,
        }),
        Command::Bench {
            kind:
                BenchKind::Stream {
                    model,
                    slots,
                    slot_size,
                    steps,
                    consume_ms_per_mib,
                    readers,
                    file_mode,
                    backend,
                    json,
                },
        } => (|| {
            let file_mode = nibble_core::io::file::FileReadMode::parse(&file_mode).ok_or_else(|| {
                anyhow::anyhow!("--file-mode '{file_mode}': expected auto, pread, pread-dropcache, direct or mmap")
            })?;
            let slot_bytes = usize::try_from(nibble_core::plan::parse_size(&slot_size)?)?;
            bench_stream::run(&bench_stream::StreamBench {
                model,
                slots,
                slot_bytes,
                steps,
                consume_ms_per_mib,
                readers,
                file_mode,
                backend,
                json,
            })
        })(),
        Command::Dequant {
            path,
            tensors,
            all,
            out,
        } => quant_cmds::dequant(&path, &tensors, all, &out),
        Command::Quantize {
            input,
            out,
            quant,
            blocksize,
            double_quant,
            include,
            exclude,
        } => quant_cmds::quantize(
            &input,
            &out,
            quant,
            blocksize,
            double_quant,
            &include,
            &exclude,
        ),
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
