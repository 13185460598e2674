//! `nibble dequant`, `nibble quantize` and `nibble convert`: the bitsandbytes 4-bit format in and
//! out of files.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::output::paths::{check_output, Reads};
use anyhow::{bail, Context, Result};
use clap::Args;
use nibble_core::format::bnb::{
    is_quant_component, Bnb4bitKeys, FloatDtype, QuantState, QuantType,
};
use nibble_core::format::dtype::f32_to_bytes;
use nibble_core::format::dtype::Dtype;
use nibble_core::format::quantize::{
    quant_state_for, quantize_4bit, state_tensor_specs, QuantizeOptions,
};
use nibble_core::format::writer::{SafetensorsWriter, TensorSpec};
use nibble_core::io::model::ModelIndex;
use regex::Regex;

/// `--quant` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantArg {
    /// NormalFloat4.
    Nf4,
    /// bitsandbytes FP4.
    Fp4,
}

/// Default `--include`: weights.
pub const DEFAULT_INCLUDE: &str = r"\.weight$";
/// Default `--exclude`: what transformers keeps unquantized (embeddings, output head).
pub const DEFAULT_EXCLUDE: &str = r"(^|\.)(lm_head|embed_tokens|wte|wpe|word_embeddings|position_embeddings|token_type_embeddings)\.weight$";

/// Options of `nibble dequant`.
#[derive(Debug, Clone, Args)]
pub struct DequantArgs {
    /// A `.safetensors` file, a model folder, or a URL of either.
    pub path: String,
    /// A 4-bit weight to dequantize (its base name, e.g. `model.layers.0.mlp.up_proj.weight`);
    /// repeat for several.
    #[arg(
        long = "tensor",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    pub tensors: Vec<String>,
    /// Dequantize every 4-bit weight.
    #[arg(long)]
    pub all: bool,
    /// Output `.safetensors` file.
    #[arg(short, long)]
    pub out: PathBuf,
}

/// Options of `nibble quantize`.
#[derive(Debug, Clone, Args)]
pub struct QuantizeArgs {
    /// A `.safetensors` file, a model folder, or a URL of either.
    pub input: String,
    /// Output `.safetensors` file.
    #[arg(short, long)]
    pub out: PathBuf,
    /// 4-bit data type.
    #[arg(long = "quant", value_enum, default_value_t = QuantArg::Nf4)]
    pub quant: QuantArg,
    /// Elements per absmax block (power of two, 32..4096; transformers uses 64).
    #[arg(long, default_value_t = 64)]
    pub blocksize: u64,
    /// Quantize absmax to 8 bits too (`bnb_4bit_use_double_quant`).
    #[arg(long)]
    pub double_quant: bool,
    /// Only tensors whose name matches this regex are quantized.
    #[arg(long, default_value = DEFAULT_INCLUDE)]
    pub include: String,
    /// Tensors whose name matches this regex are copied unchanged (default: embeddings and
    /// lm_head, as transformers leaves them; pass --exclude '' to quantize them too).
    #[arg(long, default_value = DEFAULT_EXCLUDE)]
    pub exclude: String,
}

/// Options of `nibble convert`.
#[derive(Debug, Clone, Args)]
pub struct ConvertArgs {
    /// The `.gguf` file.
    pub gguf: PathBuf,
    /// Output folder.
    #[arg(short, long)]
    pub out: PathBuf,
    /// 4-bit data type.
    #[arg(long = "quant", value_enum, default_value_t = QuantArg::Nf4)]
    pub quant: QuantArg,
    /// Quantize absmax to 8 bits too (`bnb_4bit_use_double_quant`).
    #[arg(long)]
    pub double_quant: bool,
    /// Dtype of the tensors kept unquantized (embeddings, norms, lm_head): bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
}

fn pt_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([("format".to_string(), "pt".to_string())])
}

/// Dequantizes the named (or all) 4-bit weights into an F32 safetensors file.
pub fn dequant(a: &DequantArgs) -> Result<()> {
    let (path, names, all, out) = (a.path.as_str(), &a.tensors, a.all, a.out.as_path());
    let reads = Reads {
        model: path,
        files: vec![],
    };
    check_output(out, "--out", &reads)?;
    let model = ModelIndex::open_path_or_url(path, Default::default())?;
    let weights = model.q4_weights().map(<[_]>::to_vec)?;
    let chosen: Vec<&Bnb4bitKeys> = if all {
        weights.iter().collect()
    } else {
        names
            .iter()
            .map(|n| {
                weights.iter().find(|k| &k.base == n).with_context(|| {
                    if model.get(n).is_some() {
                        format!("{}: tensor '{n}' is not a bitsandbytes 4-bit weight", path)
                    } else {
                        format!("{path}: no tensor named '{n}'")
                    }
                })
            })
            .collect::<Result<_>>()?
    };
    if chosen.is_empty() {
        bail!("{}: the model has no bitsandbytes 4-bit weights", path);
    }
    let states: Vec<QuantState> = chosen
        .iter()
        .map(|k| model.quant_state(k))
        .collect::<nibble_core::Result<_>>()?;
    let specs = chosen
        .iter()
        .zip(&states)
        .map(|(k, s)| TensorSpec {
            name: k.base.clone(),
            dtype: Dtype::F32,
            shape: s.json.shape.clone(),
        })
        .collect();
    let mut w = SafetensorsWriter::create(out, specs, &pt_metadata())?;
    for (i, (k, s)) in chosen.iter().zip(&states).enumerate() {
        let packed = model.read_bytes(model.require(&k.base)?)?;
        nibble_core::io::machine::check_alloc(
            (s.numel() as u64).saturating_mul(4),
            &format!("dequantizing {}", k.base),
        )?;
        let mut values = vec![0f32; s.numel()];
        s.dequantize(&packed, &mut values)?;
        w.write_tensor(&k.base, &f32_to_bytes(&values))?;
        eprintln!(
            "[{}/{}] {} {:?} {}",
            i + 1,
            chosen.len(),
            k.base,
            s.json.shape,
            s.json.quant_type.name()
        );
    }
    w.finish()?;
    eprintln!("wrote {} tensors to {}", chosen.len(), out.display());
    Ok(())
}

/// Quantizes matching 2-D float weights, copying every other tensor unchanged.
pub fn quantize(a: &QuantizeArgs) -> Result<()> {
    let (input, out, quant, blocksize, double_quant) = (
        a.input.as_str(),
        a.out.as_path(),
        a.quant,
        a.blocksize,
        a.double_quant,
    );
    let (include, exclude) = (a.include.as_str(), a.exclude.as_str());
    let reads = Reads {
        model: input,
        files: vec![],
    };
    check_output(out, "--out", &reads)?;
    let include = Regex::new(include).with_context(|| format!("--include '{include}'"))?;
    let exclude = if exclude.is_empty() {
        None
    } else {
        Some(Regex::new(exclude).with_context(|| format!("--exclude '{exclude}'"))?)
    };
    let quant_type = match quant {
        QuantArg::Nf4 => QuantType::Nf4,
        QuantArg::Fp4 => QuantType::Fp4,
    };
    let opts = QuantizeOptions {
        quant_type,
        blocksize,
        double_quant,
    };
    let model = ModelIndex::open_path_or_url(input, Default::default())?;
    let already: Vec<String> = model
        .q4_weights()
        .map(<[_]>::to_vec)?
        .into_iter()
        .map(|k| k.base)
        .collect();
    let selected = |name: &str, dtype: Dtype, shape: &[u64]| {
        // An empty weight has nothing to quantize: it is copied as it is.
        shape.len() == 2
            && shape.iter().all(|&d| d > 0)
            && FloatDtype::from_safetensors(dtype).is_some()
            && !already.iter().any(|b| b == name)
            && !is_quant_component(name)
            && include.is_match(name)
            && !exclude.as_ref().is_some_and(|r| r.is_match(name))
    };
    // Pass 1 lays out the header (a double-quantized weight's JSON length depends on its data).
    let mut specs = Vec::new();
    let mut plan = Vec::new();
    for t in model.tensors() {
        if selected(&t.name, t.dtype, &t.shape) {
            let values = model.read_f32(t)?;
            let dtype = FloatDtype::from_safetensors(t.dtype).context("float dtype")?;
            let json = quant_state_for(&values, &t.shape, dtype, opts)
                .with_context(|| format!("{}: tensor '{}'", model.shard_name(t.shard), t.name))?;
            specs.extend(state_tensor_specs(&t.name, &json));
            plan.push((t, true));
        } else {
            specs.push(TensorSpec {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            });
            plan.push((t, false));
        }
    }
    let mut w = SafetensorsWriter::create(out, specs, &pt_metadata())?;
    let (mut nq, mut in_bytes, mut out_bytes) = (0usize, 0u64, 0u64);
    for (t, quantize) in plan {
        if quantize {
            let values = model.read_f32(t)?;
            let dtype = FloatDtype::from_safetensors(t.dtype).context("float dtype")?;
            let q = quantize_4bit(&values, &t.shape, dtype, opts)?;
            for (name, _, _, bytes) in q.tensors(&t.name) {
                out_bytes += bytes.len() as u64;
                w.write_tensor(&name, &bytes)?;
            }
            in_bytes += t.len;
            nq += 1;
            eprintln!(
                "quantized {} {:?} {} -> {}",
                t.name,
                t.shape,
                t.len,
                quant_type.name()
            );
        } else {
            let bytes = model.read_bytes(t)?;
            w.write_tensor(&t.name, &bytes)?;
        }
    }
    w.finish()?;
    eprintln!(
        "wrote {}: {nq} weights quantized ({in_bytes} -> {out_bytes} bytes), {} tensors copied",
        out.display(),
        model.len() - nq
    );
    Ok(())
}

/// `nibble convert`: GGUF to a transformers NF4 folder.
pub fn convert(a: &ConvertArgs) -> Result<()> {
    let (gguf, out, quant, double_quant, dtype) = (
        a.gguf.as_path(),
        a.out.as_path(),
        a.quant,
        a.double_quant,
        a.dtype.as_str(),
    );
    use nibble_core::format::gguf_convert::{convert, ConvertOptions, OUTPUT_FILES};
    let reads = Reads {
        model: "",
        files: vec![gguf],
    };
    for name in OUTPUT_FILES {
        check_output(&out.join(name), "--out", &reads)?;
    }
    crate::output::folder::prepare(out, "--out")?;
    let dtype = match dtype {
        "bf16" | "bfloat16" => FloatDtype::BF16,
        "f16" | "float16" => FloatDtype::F16,
        other => anyhow::bail!("--dtype '{other}': expected bf16 or f16"),
    };
    let opts = ConvertOptions {
        quant_type: match quant {
            QuantArg::Nf4 => QuantType::Nf4,
            QuantArg::Fp4 => QuantType::Fp4,
        },
        double_quant,
        dtype,
    };
    let t = std::time::Instant::now();
    use std::io::IsTerminal;
    let tty = std::io::stderr().is_terminal();
    let mut shown = 0usize;
    let r = convert(gguf, out, opts, |done, total, name| {
        if tty {
            eprint!("\r[{done}/{total}] {name:<60}");
            if done == total {
                eprintln!();
            }
        } else if done * 10 / total.max(1) > shown || done == total {
            shown = done * 10 / total.max(1);
            eprintln!("[{done}/{total}] {name}");
        }
    })
    .with_context(|| format!("converting {}", gguf.display()))?;
    crate::output::folder::seal(out, "nibble convert")?;
    eprintln!(
        "wrote {} ({} tensors, {} linears in {}, {} bytes) and {} in {:.1} s",
        out.join("model.safetensors").display(),
        r.tensors,
        r.quantized,
        opts.quant_type.name(),
        r.bytes,
        r.files[1..].join(", "),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
