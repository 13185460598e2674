//! `nibble`: run, inspect and convert 4-bit (bitsandbytes NF4/FP4) models.

mod inspect;
mod quant_cmds;

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

#[derive(Debug, Subcommand)]
enum Command {
    /// List a model's tensors, its 4-bit weights with their quant state, totals and config.
    Inspect {
        /// A `.safetensors` file or a model folder (config.json + one file or shards).
        path: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Dequantize 4-bit weights to F32 under their base names.
    Dequant {
        /// A `.safetensors` file or a model folder.
        path: PathBuf,
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
        /// A `.safetensors` file or a model folder.
        input: PathBuf,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect { path, json } => inspect::run(&path, json),
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
