//! A synthetic diffusers Flux pipeline folder for the demo: every file a real `FLUX.1` folder
//! has that nibble reads, in the formats diffusers and transformers write them, with
//! deterministic random weights. `model_index.json`, the scheduler config, a CLIP BPE tokenizer
//! (`vocab.json` + `merges.txt`, the merges learnt from a small built-in text), a T5 unigram
//! `tokenizer.json`, a dense bfloat16 CLIP text model, a bitsandbytes NF4 T5 encoder (with `wo`
//! dense, as transformers keeps it), the NF4 Flux DiT of [`super::synth`], and a dense
//! AutoencoderKL decoder. Random weights give a noise picture: the point is the memory and
//! streaming behaviour of a real pipeline's four phases.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::json;

use super::synth::{quantization_config, Arch, Kind, SynthModel};
use crate::error::{Error, Result};

/// The shapes of a synthetic pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FluxSynthShape {
    /// Bytes of the transformer on disk (roughly; see [`SynthModel::new`]).
    pub dit_bytes: u64,
    /// T5 encoder layers (d_model 4096, d_ff 10240, 64 heads as T5-XXL).
    pub t5_layers: u64,
    /// CLIP text-model layers (768 wide, 12 heads as CLIP-L).
    pub clip_layers: u64,
    /// The VAE decoder's `block_out_channels`.
    pub vae_channels: [u64; 4],
}

impl Default for FluxSynthShape {
    fn default() -> Self {
        FluxSynthShape {
            dit_bytes: 1800 << 20,
            t5_layers: 2,
            clip_layers: 4,
            vae_channels: [64, 128, 128, 128],
        }
    }
}

/// Text the CLIP merges and the T5 pieces are learnt from.
const CORPUS: &str = "a photo of a lighthouse on a cliff at dusk, oil on canvas. a cat sitting on \
a wooden table next to a window with the morning light. the city at night, rain on the street, \
neon signs and reflections. a mountain lake surrounded by pine trees under a clear blue sky. \
portrait of an old man with a beard, studio lighting, highly detailed. a bowl of fruit, still \
life painting in the style of the old masters. an astronaut riding a horse on the moon, digital \
art. a red sports car parked in front of a modern house. sunset over the ocean with sailing \
boats and seagulls. a forest path in autumn with golden leaves and soft fog. the interior of a \
cozy library with books, a fireplace and a reading chair. a watercolor of flowers in a glass \
vase. a dragon flying over a medieval castle, fantasy illustration. close up of a dog's face, \
shallow depth of field. a bustling market street in the morning with people and colorful stalls.";

/// GPT-2's byte-to-character map, which CLIP's vocabulary is written in.
fn bytes_to_unicode() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(&chars) {
        map[*b as usize] = char::from_u32(*c).unwrap_or('?');
    }
    map
}

/// The words of the corpus as CLIP splits them (lower-case letter runs).
fn corpus_words() -> Vec<String> {
    CORPUS
        .to_lowercase()
        .split(|c: char| !c.is_alphabetic())
        .filter(|w| !w.is_empty())
        .map(String::from)
        .collect()
}

/// CLIP's `vocab.json` and `merges.txt`: the 256 byte symbols, the same with `</w>`, `merges`
/// merges learnt from the corpus by byte-pair encoding (most frequent pair first, ties by the
/// pair's text), then `<|startoftext|>` and `<|endoftext|>` (the highest id, as in CLIP).
pub fn clip_vocab(merges: usize) -> (serde_json::Value, String) {
    let map = bytes_to_unicode();
    let mut vocab: Vec<String> = map.iter().map(|c| c.to_string()).collect();
    vocab.extend(map.iter().map(|c| format!("{c}</w>")));
    let mut counts: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for w in corpus_words() {
        let mut syms: Vec<String> = w.bytes().map(|b| map[b as usize].to_string()).collect();
        if let Some(last) = syms.last_mut() {
            last.push_str("</w>");
        }
        *counts.entry(syms).or_default() += 1;
    }
    let mut words: Vec<(Vec<String>, usize)> = counts.into_iter().collect();
    let mut lines = vec!["#version: 0.2".to_string()];
    for _ in 0..merges {
        let mut pairs: HashMap<(String, String), usize> = HashMap::new();
        for (syms, n) in &words {
            for p in syms.windows(2) {
                *pairs.entry((p[0].clone(), p[1].clone())).or_default() += n;
            }
        }
        let Some(((a, b), _)) = pairs
            .into_iter()
            .max_by(|x, y| x.1.cmp(&y.1).then_with(|| y.0.cmp(&x.0)))
        else {
            break;
        };
        let joined = format!("{a}{b}");
        for (syms, _) in words.iter_mut() {
            let mut out = Vec::with_capacity(syms.len());
            let mut i = 0;
            while i < syms.len() {
                if i + 1 < syms.len() && syms[i] == a && syms[i + 1] == b {
                    out.push(joined.clone());
                    i += 2;
                } else {
                    out.push(syms[i].clone());
                    i += 1;
                }
            }
            *syms = out;
        }
        lines.push(format!("{a} {b}"));
        vocab.push(joined);
    }
    vocab.push("<|startoftext|>".into());
    vocab.push("<|endoftext|>".into());
    let v: serde_json::Map<String, serde_json::Value> = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, json!(i)))
        .collect();
    (serde_json::Value::Object(v), lines.join("\n") + "\n")
}

/// T5's `tokenizer.json`: a unigram model over `<pad>`, `</s>`, `<unk>`, the corpus's words and
/// their letters (log-probabilities from their counts), with T5's pre-tokenizer, `</s>`
/// template and decoder. The normalizer is NFKC (T5's precompiled map is NFKC-based).
pub fn t5_tokenizer_json() -> serde_json::Value {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for w in CORPUS.split_whitespace() {
        let w: String = w.chars().filter(|c| c.is_alphanumeric()).collect();
        if !w.is_empty() {
            *counts.entry(format!("\u{2581}{w}")).or_default() += 1;
        }
    }
    let total: usize = counts.values().sum::<usize>().max(1);
    let mut vocab: Vec<(String, f64)> = vec![
        ("<pad>".into(), 0.0),
        ("</s>".into(), 0.0),
        ("<unk>".into(), 0.0),
        ("\u{2581}".into(), -3.0),
    ];
    let mut words: Vec<(String, usize)> = counts.into_iter().collect();
    words.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    vocab.extend(
        words
            .iter()
            .map(|(w, n)| (w.clone(), (*n as f64 / total as f64).ln())),
    );
    let singles = (b'a'..=b'z')
        .chain(b'A'..=b'Z')
        .chain(b'0'..=b'9')
        .map(|b| (b as char).to_string())
        .chain([".", ",", "'", "-", "!", "?", ":", ";"].map(String::from));
    for s in singles {
        vocab.push((format!("\u{2581}{s}"), -11.0));
        vocab.push((s, -12.0));
    }
    let special = |id: usize, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let metaspace = json!({"type": "Metaspace", "replacement": "\u{2581}",
                           "prepend_scheme": "always", "split": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "</s>"), special(2, "<unk>")],
        "normalizer": {"type": "NFKC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"},
                          metaspace.clone()]},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "</s>", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 0}},
                     {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}},
        "decoder": metaspace,
        "model": {"type": "Unigram", "unk_id": 2, "byte_fallback": false,
                  "vocab": vocab.into_iter().map(|(p, s)| json!([p, s])).collect::<Vec<_>>()}
    })
}

pub(crate) fn linear(
    t: &mut Vec<(String, Kind)>,
    name: &str,
    out: u64,
    inp: u64,
    quant: bool,
    bias: bool,
) {
    let w = if quant {
        Kind::Quant(vec![out, inp])
    } else {
        Kind::Dense(vec![out, inp], 0.0)
    };
    t.push((format!("{name}.weight"), w));
    if bias {
        t.push((format!("{name}.bias"), Kind::Dense(vec![out], 0.0)));
    }
}

pub(crate) fn norm(t: &mut Vec<(String, Kind)>, name: &str, width: u64, bias: bool) {
    t.push((format!("{name}.weight"), Kind::Dense(vec![width], 1.0)));
    if bias {
        t.push((format!("{name}.bias"), Kind::Dense(vec![width], 0.0)));
    }
}

/// A CLIP text model (transformers' `CLIPTextModel`, bfloat16) of `layers` layers.
fn clip(vocab: u64, layers: u64, seed: u64) -> SynthModel {
    let (h, i, heads) = (768u64, 3072u64, 12u64);
    let mut t = vec![
        (
            "text_model.embeddings.token_embedding.weight".to_string(),
            Kind::Dense(vec![vocab, h], 0.0),
        ),
        (
            "text_model.embeddings.position_embedding.weight".to_string(),
            Kind::Dense(vec![77, h], 0.0),
        ),
    ];
    for l in 0..layers {
        let p = format!("text_model.encoder.layers.{l}");
        norm(&mut t, &format!("{p}.layer_norm1"), h, true);
        for q in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            linear(&mut t, &format!("{p}.self_attn.{q}"), h, h, false, true);
        }
        norm(&mut t, &format!("{p}.layer_norm2"), h, true);
        linear(&mut t, &format!("{p}.mlp.fc1"), i, h, false, true);
        linear(&mut t, &format!("{p}.mlp.fc2"), h, i, false, true);
    }
    norm(&mut t, "text_model.final_layer_norm", h, true);
    let config = json!({
        "architectures": ["CLIPTextModel"], "model_type": "clip_text_model",
        "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0, "dtype": "bfloat16",
        "eos_token_id": 2, "hidden_act": "quick_gelu", "hidden_size": h,
        "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": i,
        "layer_norm_eps": 1e-5, "max_position_embeddings": 77, "num_attention_heads": heads,
        "num_hidden_layers": layers, "pad_token_id": 1, "projection_dim": h,
        "vocab_size": vocab, "nibble_synthetic": {"seed": seed},
    });
    SynthModel::from_parts(
        config,
        t,
        "model.safetensors",
        "model.safetensors.index.json",
        seed,
    )
}

/// A T5 encoder (transformers' `T5EncoderModel` with bitsandbytes NF4: every Linear but `wo`);
/// with `umt5`, transformers' `UMT5EncoderModel` (a relative position bias in every layer).
pub(crate) fn t5(vocab: u64, layers: u64, seed: u64, umt5: bool) -> SynthModel {
    let (d, ff, heads, d_kv, buckets) = (4096u64, 10240u64, 64u64, 64u64, 32u64);
    let inner = heads * d_kv;
    let mut t = vec![(
        "shared.weight".to_string(),
        Kind::Dense(vec![vocab, d], 0.0),
    )];
    for l in 0..layers {
        let p = format!("encoder.block.{l}.layer");
        for q in ["q", "k", "v"] {
            linear(
                &mut t,
                &format!("{p}.0.SelfAttention.{q}"),
                inner,
                d,
                true,
                false,
            );
        }
        linear(
            &mut t,
            &format!("{p}.0.SelfAttention.o"),
            d,
            inner,
            true,
            false,
        );
        if l == 0 || umt5 {
            t.push((
                format!("{p}.0.SelfAttention.relative_attention_bias.weight"),
                Kind::Dense(vec![buckets, heads], 0.0),
            ));
        }
        norm(&mut t, &format!("{p}.0.layer_norm"), d, false);
        for w in ["wi_0", "wi_1"] {
            linear(
                &mut t,
                &format!("{p}.1.DenseReluDense.{w}"),
                ff,
                d,
                true,
                false,
            );
        }
        linear(
            &mut t,
            &format!("{p}.1.DenseReluDense.wo"),
            d,
            ff,
            false,
            false,
        );
        norm(&mut t, &format!("{p}.1.layer_norm"), d, false);
    }
    norm(&mut t, "encoder.final_layer_norm", d, false);
    let (arch, model_type) = if umt5 {
        ("UMT5EncoderModel", "umt5")
    } else {
        ("T5EncoderModel", "t5")
    };
    let config = json!({
        "architectures": [arch], "model_type": model_type, "classifier_dropout": 0.0,
        "d_ff": ff, "d_kv": d_kv, "d_model": d, "decoder_start_token_id": 0,
        "dense_act_fn": "gelu_new", "dropout_rate": 0.1, "dtype": "bfloat16", "eos_token_id": 1,
        "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0, "is_encoder_decoder": true,
        "is_gated_act": true, "layer_norm_epsilon": 1e-6, "num_decoder_layers": layers,
        "num_heads": heads, "num_layers": layers, "pad_token_id": 0,
        "relative_attention_max_distance": 128, "relative_attention_num_buckets": buckets,
        "tie_word_embeddings": false, "use_cache": true, "vocab_size": vocab,
        "quantization_config": quantization_config(), "nibble_synthetic": {"seed": seed},
    });
    SynthModel::from_parts(
        config,
        t,
        "model.safetensors",
        "model.safetensors.index.json",
        seed,
    )
}

/// A 3x3 (or 1x1) convolution with variance-keeping random weights.
fn conv(t: &mut Vec<(String, Kind)>, name: &str, out: u64, inp: u64, k: u64) {
    let sd = 1.0 / ((inp * k * k) as f32).sqrt();
    t.push((
        format!("{name}.weight"),
        Kind::Normal(vec![out, inp, k, k], sd),
    ));
    t.push((format!("{name}.bias"), Kind::Dense(vec![out], 0.0)));
}

fn resnet(t: &mut Vec<(String, Kind)>, p: &str, inp: u64, out: u64) {
    norm(t, &format!("{p}.norm1"), inp, true);
    conv(t, &format!("{p}.conv1"), out, inp, 3);
    norm(t, &format!("{p}.norm2"), out, true);
    conv(t, &format!("{p}.conv2"), out, out, 3);
    if inp != out {
        conv(t, &format!("{p}.conv_shortcut"), out, inp, 1);
    }
}

/// An AutoencoderKL decoder as diffusers names it (the encoder, which the pipeline does not
/// run, is left out), Flux's 16 latent channels and scaling.
fn vae(channels: [u64; 4], seed: u64) -> SynthModel {
    let (latent, layers_per_block, groups) = (16u64, 1u64, 32u64);
    let mut t = Vec::new();
    let top = channels[3];
    conv(&mut t, "decoder.conv_in", top, latent, 3);
    for r in 0..2 {
        resnet(&mut t, &format!("decoder.mid_block.resnets.{r}"), top, top);
    }
    norm(
        &mut t,
        "decoder.mid_block.attentions.0.group_norm",
        top,
        true,
    );
    for q in ["to_q", "to_k", "to_v", "to_out.0"] {
        let sd = 1.0 / (top as f32).sqrt();
        t.push((
            format!("decoder.mid_block.attentions.0.{q}.weight"),
            Kind::Normal(vec![top, top], sd),
        ));
        t.push((
            format!("decoder.mid_block.attentions.0.{q}.bias"),
            Kind::Dense(vec![top], 0.0),
        ));
    }
    let mut prev = top;
    for (i, &out) in channels.iter().rev().enumerate() {
        for r in 0..=layers_per_block {
            let inp = if r == 0 { prev } else { out };
            resnet(
                &mut t,
                &format!("decoder.up_blocks.{i}.resnets.{r}"),
                inp,
                out,
            );
        }
        if i + 1 < channels.len() {
            conv(
                &mut t,
                &format!("decoder.up_blocks.{i}.upsamplers.0.conv"),
                out,
                out,
                3,
            );
        }
        prev = out;
    }
    norm(&mut t, "decoder.conv_norm_out", channels[0], true);
    conv(&mut t, "decoder.conv_out", 3, channels[0], 3);
    let config = json!({
        "_class_name": "AutoencoderKL", "_diffusers_version": "0.42.1", "act_fn": "silu",
        "block_out_channels": channels, "down_block_types": vec!["DownEncoderBlock2D"; 4],
        "force_upcast": true, "in_channels": 3, "latent_channels": latent,
        "latents_mean": null, "latents_std": null, "layers_per_block": layers_per_block,
        "mid_block_add_attention": true, "norm_num_groups": groups, "out_channels": 3,
        "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
        "up_block_types": vec!["UpDecoderBlock2D"; 4], "use_post_quant_conv": false,
        "use_quant_conv": false, "nibble_synthetic": {"seed": seed, "decoder_only": true},
    });
    SynthModel::from_parts(
        config,
        t,
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model.safetensors.index.json",
        seed,
    )
}

/// The four models of a synthetic pipeline, by component folder.
pub fn components(shape: FluxSynthShape, seed: u64) -> Vec<(&'static str, SynthModel)> {
    let (vocab, _) = clip_vocab(CLIP_MERGES);
    let clip_vocab_len = vocab.as_object().map_or(0, |v| v.len()) as u64;
    let t5_pieces = t5_tokenizer_json()["model"]["vocab"]
        .as_array()
        .map_or(0, |v| v.len()) as u64;
    vec![
        (
            "text_encoder",
            clip(clip_vocab_len, shape.clip_layers, seed + 1),
        ),
        (
            "text_encoder_2",
            // T5 checkpoints pad the embedding rows to a multiple of 128.
            t5(
                t5_pieces.div_ceil(128) * 128,
                shape.t5_layers,
                seed + 2,
                false,
            ),
        ),
        (
            "transformer",
            SynthModel::new(Arch::Dit, shape.dit_bytes, seed),
        ),
        ("vae", vae(shape.vae_channels, seed + 3)),
    ]
}

const CLIP_MERGES: usize = 400;

pub(crate) fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display().to_string(), e))?;
    }
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap_or_default())
        .map_err(|e| Error::io(path.display().to_string(), e))
}

/// A T5 (or umT5) tokenizer folder as transformers writes it: `tokenizer.json` (`tokenizer`),
/// `tokenizer_config.json` and `special_tokens_map.json`.
pub(crate) fn write_t5_tokenizer(dir: &Path, tokenizer: &serde_json::Value) -> Result<()> {
    write_json(&dir.join("tokenizer.json"), tokenizer)?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"clean_up_tokenization_spaces": true, "eos_token": "</s>", "extra_ids": 0,
                "legacy": true, "model_max_length": 512, "pad_token": "<pad>",
                "tokenizer_class": "T5Tokenizer", "unk_token": "<unk>"}),
    )?;
    write_json(
        &dir.join("special_tokens_map.json"),
        &json!({"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}),
    )
}

/// Writes the whole pipeline folder into `dir`, calling `progress(component, done, total)` as
/// the models' bytes are written.
pub fn write_pipeline(
    dir: &Path,
    shape: FluxSynthShape,
    seed: u64,
    mut progress: impl FnMut(&str, u64, u64),
) -> Result<()> {
    write_json(
        &dir.join("model_index.json"),
        &json!({
            "_class_name": "FluxPipeline", "_diffusers_version": "0.42.1",
            "feature_extractor": [null, null], "image_encoder": [null, null],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "FluxTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        }),
    )?;
    write_json(
        &dir.join("scheduler/scheduler_config.json"),
        &json!({
            "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.42.1",
            "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": false,
            "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000,
            "shift": 3.0, "shift_terminal": null, "stochastic_sampling": false,
            "time_shift_type": "exponential", "use_beta_sigmas": false,
            "use_dynamic_shifting": true, "use_exponential_sigmas": false,
            "use_karras_sigmas": false,
        }),
    )?;
    let (vocab, merges) = clip_vocab(CLIP_MERGES);
    let n = vocab.as_object().map_or(0, |v| v.len());
    write_json(&dir.join("tokenizer/vocab.json"), &vocab)?;
    let p = dir.join("tokenizer/merges.txt");
    std::fs::write(&p, merges).map_err(|e| Error::io(p.display().to_string(), e))?;
    let special = |id: usize, normalized: bool, content: &str| {
        json!({"content": content, "lstrip": false, "normalized": normalized,
               "rstrip": false, "single_word": false, "special": true, "id": id})
    };
    write_json(
        &dir.join("tokenizer/tokenizer_config.json"),
        &json!({
            "add_prefix_space": false,
            "added_tokens_decoder": {
                (n - 2).to_string(): special(n - 2, true, "<|startoftext|>"),
                (n - 1).to_string(): special(n - 1, false, "<|endoftext|>"),
            },
            "bos_token": "<|startoftext|>", "clean_up_tokenization_spaces": true,
            "do_lower_case": true, "eos_token": "<|endoftext|>", "errors": "replace",
            "model_max_length": 77, "pad_token": "<|endoftext|>",
            "tokenizer_class": "CLIPTokenizer", "unk_token": "<|endoftext|>",
        }),
    )?;
    write_json(
        &dir.join("tokenizer/special_tokens_map.json"),
        &json!({"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}),
    )?;
    write_t5_tokenizer(&dir.join("tokenizer_2"), &t5_tokenizer_json())?;
    for (name, model) in components(shape, seed) {
        model.write(&dir.join(name), |done, total| progress(name, done, total))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_merges_are_learnt_most_frequent_first_and_end_words() {
        let (vocab, merges) = clip_vocab(50);
        let v = vocab.as_object().expect("object");
        assert_eq!(v.len(), 512 + 50 + 2);
        assert_eq!(v["<|endoftext|>"], json!(563));
        let lines: Vec<&str> = merges.lines().collect();
        assert_eq!(lines[0], "#version: 0.2");
        assert_eq!(lines.len(), 51);
        // Every merge's result is in the vocabulary.
        for l in &lines[1..] {
            let (a, b) = l.split_once(' ').expect("pair");
            assert!(v.contains_key(&format!("{a}{b}")), "{l}");
        }
    }
}
