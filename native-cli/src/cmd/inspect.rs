//! `nibble inspect`: what a model holds, without reading its weights.

use anyhow::Result;
use clap::Args;
use nibble_core::format::bnb::QuantState;
use nibble_core::format::dtype::dtype_name;
use nibble_core::format::safetensors::TensorEntry;
use nibble_core::io::model::ModelIndex;
use serde_json::{json, Value};

macro_rules! outln {
    ($o:expr, $($t:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($o, $($t)*);
    }};
}

/// config.json keys worth a line in the summary, when present.
const CONFIG_KEYS: [&str; 16] = [
    "model_type",
    "architectures",
    "_class_name",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
    "num_layers",
    "num_single_layers",
    "torch_dtype",
];

fn tensor_json(model: &ModelIndex, t: &TensorEntry) -> Value {
    json!({
        "name": t.name,
        "dtype": dtype_name(t.dtype),
        "shape": t.shape,
        "bytes": t.len,
        "file": model.shard_name(t.shard),
        "offset": t.offset,
    })
}

/// Prints the inventory of a model file or folder. Over HTTP only headers are fetched unless
/// `quant_state` asks for the small quant-state tensors too.
/// Options of `nibble inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// A `.safetensors` file, a model folder (config.json + one file or shards), or an http(s)
    /// URL of either (only headers are fetched).
    pub path: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also show each 4-bit weight's quant state (reads its small tensors).
    #[arg(long)]
    pub quant_state: bool,
}

/// Prints what the model holds.
pub fn run(a: &InspectArgs) -> Result<()> {
    let (path, as_json, quant_state) = (a.path.as_str(), a.json, a.quant_state);
    let model = ModelIndex::open_path_or_url(path, Default::default())?;
    let remote = path.starts_with("http://") || path.starts_with("https://");
    let weights = model.q4_weights().map(<[_]>::to_vec)?;
    let mut quantized = Vec::with_capacity(weights.len());
    for k in &weights {
        let state = if remote && !quant_state {
            None
        } else {
            Some(model.quant_state(k)?)
        };
        quantized.push((k, state));
    }
    // Without the quant state the logical size is known from the packed bytes to within one.
    let numel = |k: &nibble_core::format::bnb::Bnb4bitKeys, s: &Option<QuantState>| match s {
        Some(s) => s.json.numel(),
        None => model.get(&k.base).map(|t| t.len * 2).unwrap_or(0),
    };
    let owner_of = |name: &str| {
        quantized
            .iter()
            .position(|(k, _)| k.all_keys().contains(&name))
    };
    let quant_params: u64 = quantized.iter().map(|(k, s)| numel(k, s)).sum();
    let plain_params: u64 = model
        .tensors()
        .filter(|t| owner_of(&t.name).is_none())
        .map(|t| t.numel())
        .sum();
    let tensor_bytes: u64 = model.tensors().map(|t| t.len).sum();
    let config = model.config.clone().unwrap_or(Value::Null);
    let config_summary: serde_json::Map<String, Value> = CONFIG_KEYS
        .iter()
        .filter_map(|k| config.get(*k).map(|v| (k.to_string(), v.clone())))
        .collect();
    let qconfig = config
        .get("quantization_config")
        .cloned()
        .unwrap_or(Value::Null);

    let mut o = String::new();
    if as_json {
        let out = json!({
            "path": path.to_string(),
            "files": model.shards.iter().map(|s| json!({
                "file": s.header.file,
                "bytes": s.header.file_len,
                "header_bytes": s.header.header_len,
                "tensors": s.header.tensors.len(),
                "metadata": s.header.metadata,
            })).collect::<Vec<_>>(),
            "tensors": model.tensors().map(|t| tensor_json(&model, t)).collect::<Vec<_>>(),
            "quantized": quantized.iter().map(|(k, s)| json!({
                "name": k.base,
                "quant_type": k.quant_type.name(),
                "double_quant": k.nested_absmax.is_some(),
                "quant_state_fetched": s.is_some(),
                "blocksize": s.as_ref().map(|s| s.json.blocksize),
                "nested_blocksize": s.as_ref().and_then(|s| s.json.nested.as_ref().map(|n| n.blocksize)),
                "nested_offset": s.as_ref().and_then(|s| s.json.nested.as_ref().map(|n| n.offset)),
                "shape": s.as_ref().map(|s| s.json.shape.clone()),
                "dtype": s.as_ref().map(|s| s.json.dtype.name()),
                "parameters": numel(k, s),
                "bytes": k.all_keys().iter().filter_map(|n| model.get(n)).map(|t| t.len).sum::<u64>(),
                "components": k.all_keys(),
            })).collect::<Vec<_>>(),
            "totals": {
                "file_bytes": model.file_bytes(),
                "tensor_bytes": tensor_bytes,
                "tensors": model.len(),
                "quantized_weights": quantized.len(),
                "parameters": quant_params + plain_params,
                "quantized_parameters": quant_params,
            },
            "config": config_summary,
            "quantization_config": qconfig,
        });
        outln!(o, "{}", serde_json::to_string_pretty(&out)?);
        return crate::output::write_stdout(&o);
    }

    outln!(o, "{}", path);
    for s in &model.shards {
        outln!(
            o,
            "  file {}  {} bytes, header {} bytes, {} tensors",
            s.header.file,
            s.header.file_len,
            s.header.header_len,
            s.header.tensors.len()
        );
    }
    o.push('\n');
    let name_w = model
        .tensors()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .clamp(4, 72);
    outln!(
        o,
        "{:<name_w$}  {:<5}  {:<16}  {:>12}",
        "TENSOR",
        "DTYPE",
        "SHAPE",
        "BYTES"
    );
    for t in model.tensors() {
        match owner_of(&t.name) {
            Some(i) if quantized[i].0.base == t.name => {
                let (k, s) = &quantized[i];
                let bytes: u64 = k
                    .all_keys()
                    .iter()
                    .filter_map(|n| model.get(n))
                    .map(|t| t.len)
                    .sum();
                let dq = if k.nested_absmax.is_some() {
                    " double-quant"
                } else {
                    ""
                };
                let (shape, detail) = match s {
                    Some(s) => (
                        format!("{:?}", s.json.shape),
                        format!("blocksize {}{dq} {}", s.json.blocksize, s.json.dtype.name()),
                    ),
                    None => (
                        "?".to_string(),
                        format!("{dq} (quant state not fetched: --quant-state)"),
                    ),
                };
                outln!(
                    o,
                    "{:<name_w$}  {:<5}  {:<16}  {:>12}  {} {}",
                    t.name,
                    k.quant_type.name(),
                    shape,
                    bytes,
                    k.quant_type.name(),
                    detail.trim_start()
                );
                for c in k.all_keys() {
                    if let Some(ct) = model.get(c) {
                        outln!(
                            o,
                            "  {:<w2$}  {:<5}  {:<16}  {:>12}",
                            c,
                            dtype_name(ct.dtype),
                            format!("{:?}", ct.shape),
                            ct.len,
                            w2 = name_w - 2
                        );
                    }
                }
            }
            Some(_) => {}
            None => outln!(
                o,
                "{:<name_w$}  {:<5}  {:<16}  {:>12}",
                t.name,
                dtype_name(t.dtype),
                format!("{:?}", t.shape),
                t.len
            ),
        }
    }
    o.push('\n');
    outln!(
        o,
        "totals: {} bytes on disk, {} tensors, {} parameters ({} in {} 4-bit weights)",
        model.file_bytes(),
        model.len(),
        quant_params + plain_params,
        quant_params,
        quantized.len()
    );
    if !config_summary.is_empty() {
        let parts: Vec<String> = config_summary
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        outln!(o, "config: {}", parts.join(", "));
    }
    if let Value::Object(q) = &qconfig {
        let parts: Vec<String> = q
            .iter()
            .filter(|(k, _)| !k.starts_with('_'))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        outln!(o, "quantization_config: {}", parts.join(", "));
    }
    crate::output::write_stdout(&o)
}
