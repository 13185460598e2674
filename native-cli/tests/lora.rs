//! `nibble run --lora` end to end against what diffusers and peft computed with the same
//! adapters (../shared/fixtures/tiny-flux-pipeline/lora and tiny-llama-nf4/lora): the Flux
//! pipeline's final latents, decoded image and PNG with one LoRA in diffusers', kohya's and
//! metadata-less naming at scales 1 and 0.6, resident and streamed, with the bytes streamed per
//! denoising step unchanged by the adapter; a Llama's greedy tokens with two peft adapters.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nibble_core::io::model::ModelIndex;

fn shared(rel: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures")
        .join(rel);
    assert!(p.exists(), "fixture missing at {}", p.display());
    p
}

fn nibble(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .output()
        .expect("run nibble")
}

use nibble_tests::{max_err_rel_to_max as rel, tensor_f32 as f32s};

/// Runs the fixture's call with `lora` (none: the base) and returns the `--json` report and the
/// intermediates, after checking latents, image and PNG against condition `cond`.
fn flux(backend: &str, streamed: bool, lora: Option<&str>, cond: &str) -> serde_json::Value {
    let dir = shared("tiny-flux-pipeline");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("lora/manifest.json")).expect("manifest"))
            .expect("json");
    let run = &manifest["run"];
    let num = |k: &str| run[k].as_u64().expect(k).to_string();
    let tmp = tempfile::tempdir().expect("tmp");
    let (png, inter) = (tmp.path().join("o.png"), tmp.path().join("i.safetensors"));
    let mut args: Vec<String> = vec![
        "run".into(),
        "--model".into(),
        dir.join("pipeline").display().to_string(),
        "--prompt".into(),
        run["prompt"].as_str().expect("prompt").into(),
        "--height".into(),
        num("height"),
        "--width".into(),
        num("width"),
        "--steps".into(),
        num("num_inference_steps"),
        "--guidance".into(),
        run["guidance_scale"].as_f64().expect("g").to_string(),
        "--max-sequence-length".into(),
        num("max_sequence_length"),
        "--seed".into(),
        num("generator_seed"),
        "--backend".into(),
        backend.into(),
        "--out".into(),
        png.display().to_string(),
        "--intermediates".into(),
        inter.display().to_string(),
        "--json".into(),
    ];
    if streamed {
        args.extend(["--stream-all", "--slots", "2", "--slot-size", "64KiB"].map(String::from));
    }
    if let Some(l) = lora {
        args.extend([
            "--lora".to_string(),
            dir.join("lora").join(l).display().to_string(),
        ]);
    }
    let what = format!("{backend} streamed={streamed} {lora:?}");
    let o = nibble(&args);
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).expect("--json");
    let got = ModelIndex::open(&inter).expect("intermediates");
    let want = ModelIndex::open(&dir.join("lora/expected.safetensors")).expect("expected");
    for n in ["final_latents_packed", "vae_input", "image_f32"] {
        let e = rel(&f32s(&got, n), &f32s(&want, &format!("{cond}.{n}")));
        assert!(e <= 1e-4, "{what}: {n} error {e:e} x max");
    }
    let dec = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&png).expect("png"),
    ));
    let mut reader = dec.read_info().expect("png header");
    let mut buf = vec![0u8; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("png data");
    let u8_want = want
        .read_bytes(want.require(&format!("{cond}.image_u8")).expect("image_u8"))
        .expect("read");
    let far = buf[..info.buffer_size()]
        .iter()
        .zip(&u8_want)
        .filter(|(a, b)| a.abs_diff(**b) > 1)
        .count();
    assert_eq!(far, 0, "{what}: pixels more than 1 away from diffusers'");
    report
}

fn step_bytes(report: &serde_json::Value) -> Vec<u64> {
    report["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| s["bytes_streamed"].as_u64().expect("bytes"))
        .collect()
}

fn flux_on(backend: &str) {
    let base = flux(backend, true, None, "base");
    for streamed in [false, true] {
        for (file, cond) in [
            ("diffusers/pytorch_lora_weights.safetensors", "lora_full"),
            ("kohya/lora_kohya.safetensors", "lora_full"),
            (
                "diffusers_no_metadata/pytorch_lora_weights.safetensors",
                "lora_full",
            ),
            (
                "diffusers/pytorch_lora_weights.safetensors:0.6",
                "lora_scaled",
            ),
            ("kohya/lora_kohya.safetensors:0.6", "lora_scaled"),
        ] {
            let r = flux(backend, streamed, Some(file), cond);
            if streamed {
                assert_eq!(
                    step_bytes(&r),
                    step_bytes(&base),
                    "{backend} {file}: bytes streamed per step as without the adapter"
                );
            }
        }
    }
}

#[test]
fn flux_lora_on_cpu_ref() {
    flux_on("cpu-ref");
}

#[test]
fn flux_lora_on_cpu() {
    flux_on("cpu");
}

#[test]
fn flux_lora_on_wgpu() {
    if std::env::var_os("NIBBLE_REQUIRE_WGPU").is_none() && nibble_wgpu::WgpuBackend::new().is_err()
    {
        eprintln!("no wgpu adapter: skipped");
        return;
    }
    flux_on("wgpu");
}

/// Two peft adapters on the Llama through `nibble run`: peft's greedy tokens, and a line per
/// adapter saying what it adapts and keeps resident.
#[test]
fn two_adapters_on_a_language_model() {
    let e = ModelIndex::open(&shared("tiny-llama-nf4/lora/expected.safetensors")).expect("exp");
    let ids = |n: &str| -> Vec<String> {
        e.read_bytes(e.require(n).expect(n))
            .expect("read")
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8")).to_string())
            .collect()
    };
    let prompt = ids("prompt_ids").join(",");
    let want = ids("both.greedy_tokens");
    let lora = shared("tiny-llama-nf4/lora");
    let o = nibble(&[
        "run".into(),
        "--model".into(),
        shared("tiny-llama-nf4/model").display().to_string(),
        "--prompt-ids".into(),
        prompt,
        "--max-tokens".into(),
        want.len().to_string(),
        "--ignore-eos".into(),
        "--lora".into(),
        lora.join("attn_qv").display().to_string(),
        "--lora".into(),
        lora.join("all_linear").display().to_string(),
        "--json".into(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).expect("--json");
    let got: Vec<String> = report["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("tokens in {report}"))
        .iter()
        .map(|t| t.to_string())
        .collect();
    assert_eq!(got, want);
    let o = nibble(&[
        "plan".into(),
        "--model".into(),
        shared("tiny-llama-nf4/model").display().to_string(),
        "--lora".into(),
        format!("{}:0.5", lora.join("attn_qv").display()),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("lora attn_qv: 4 linears, scale 0.5"), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        format!("{out}{err}").contains("lora attn_qv"),
        "the plan lists the adapter's group: {out}{err}"
    );
}

/// A LoRA file for another model kind, or with keys this model does not have, is refused
/// naming the key.
#[test]
fn an_adapter_for_another_model_is_refused() {
    for (file, says) in [
        ("kohya/lora_kohya.safetensors", ["lora_unet_", "kohya"]),
        (
            "diffusers/pytorch_lora_weights.safetensors",
            ["transformer.", "model has no"],
        ),
    ] {
        let o = nibble(&[
            "run".into(),
            "--model".into(),
            shared("tiny-llama-nf4/model").display().to_string(),
            "--prompt-ids".into(),
            "1,2".into(),
            "--lora".into(),
            shared("tiny-flux-pipeline/lora")
                .join(file)
                .display()
                .to_string(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{file}: {err}");
        assert!(
            says.iter().all(|s| err.contains(s)),
            "{file}: names the key: {err}"
        );
    }
}

/// `nibble serve --lora`: two adapters named at start, listed by /v1/models, selected per
/// request by `"model": "<id>:<name>"`; three sequences (each adapter and none) decoded together
/// give the text of their solo requests, and that of `nibble run` with the same adapter, whose
/// tokens are peft's.
#[test]
fn the_server_batches_sequences_with_different_adapters() {
    use nibble_tests::process::Served;
    use serde_json::json;
    let dir = tempfile::tempdir().expect("tmp");
    nibble_tests::copy_dir(&shared("tiny-llama-nf4/model"), dir.path());
    // One word per token id ("t0" .. "t255"), joined by spaces: the text spells the tokens.
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..256).map(|i| (format!("t{i}"), json!(i))).collect();
    let tok = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}});
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).expect("tokenizer.json");
    let lora = shared("tiny-llama-nf4/lora");
    let qv = format!("qv={}", lora.join("attn_qv").display());
    let all = format!("all={}:0.5", lora.join("all_linear").display());
    let s = std::sync::Arc::new(Served::api(
        env!("CARGO_BIN_EXE_nibble"),
        dir.path(),
        &[
            "--model-id",
            "tiny",
            "--max-batch",
            "4",
            "--lora",
            &qv,
            "--lora",
            &all,
        ],
    ));
    let e = ModelIndex::open(&shared("tiny-llama-nf4/lora/expected.safetensors")).expect("exp");
    let prompt: Vec<u64> = e
        .read_bytes(e.require("prompt_ids").expect("prompt"))
        .expect("read")
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u64)
        .collect();
    let (status, _, b) = s.request("GET", "/v1/models", &[], b"");
    assert_eq!(status, 200);
    let models: serde_json::Value = serde_json::from_slice(&b).expect("json");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["tiny", "tiny:qv", "tiny:all"]);
    let body = |model: &str| {
        json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
               "ignore_eos": true})
    };
    let text = |v: &serde_json::Value| v["choices"][0]["text"].as_str().expect("text").to_string();
    let models = ["tiny:qv", "tiny", "tiny:all"];
    let solo: Vec<String> = models
        .iter()
        .map(|m| {
            let (status, v) = s.post("/v1/completions", &body(m));
            assert_eq!(status, 200, "{m}: {v}");
            assert_eq!(v["model"], *m);
            text(&v)
        })
        .collect();
    // The texts spell peft's greedy tokens (the base's: the base fixture's).
    let base = ModelIndex::open(&shared("tiny-llama-nf4/expected.safetensors")).expect("base");
    let tokens = |m: &ModelIndex, n: &str| -> String {
        m.read_bytes(m.require(n).expect(n))
            .expect("read")
            .chunks_exact(8)
            .take(8)
            .map(|c| format!("t{}", i64::from_le_bytes(c.try_into().expect("8"))))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let want = [
        tokens(&e, "attn_qv.greedy_tokens"),
        tokens(&base, "greedy_tokens_deq"),
        tokens(&e, "scaled.greedy_tokens"),
    ];
    for ((got, want), m) in solo.iter().zip(&want).zip(models) {
        assert_eq!(got.trim(), want, "{m}: peft's tokens");
    }
    let handles: Vec<_> = models
        .iter()
        .map(|m| {
            let (b, c) = (body(m), s.clone());
            std::thread::spawn(move || {
                let (status, v) = c.post("/v1/completions", &b);
                assert_eq!(status, 200, "{v}");
                v
            })
        })
        .collect();
    for ((h, want), m) in handles.into_iter().zip(&solo).zip(models) {
        assert_eq!(&text(&h.join().expect("client")), want, "{m} batched");
    }
    assert!(
        s.metric("batch_size_max") > 1.0,
        "the sequences were decoded together"
    );
    // The solo texts are `nibble run`'s with the same adapter (whose tokens are peft's, above).
    let ids = prompt
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    for (m, want) in models.iter().zip(&solo) {
        let mut args: Vec<String> = vec![
            "run".into(),
            "--model".into(),
            dir.path().display().to_string(),
            "--prompt-ids".into(),
            ids.clone(),
            "--max-tokens".into(),
            "8".into(),
            "--ignore-eos".into(),
            "--json".into(),
        ];
        match *m {
            "tiny:qv" => args.extend(["--lora".into(), lora.join("attn_qv").display().to_string()]),
            "tiny:all" => args.extend([
                "--lora".into(),
                format!("{}:0.5", lora.join("all_linear").display()),
            ]),
            _ => {}
        }
        let o = nibble(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(r["text"].as_str().expect("text"), want, "{m}: nibble run");
    }
    let (status, v) = s.post("/v1/completions", &body("tiny:nope"));
    assert_eq!(status, 404, "{v}");
    assert!(
        v.to_string().contains("tiny:qv"),
        "lists what is served: {v}"
    );
}

/// `(module, ΔW [out * in] row-major, Δb [out])`: a delta merged into a model's weights.
type Delta = (String, Vec<f32>, Option<Vec<f32>>);

/// Writes `dst`: the safetensors file `src` with each delta merged into f32 `module.weight` and
/// `module.bias` (4-bit weights dequantized by `nibble dequant`, bf16 ones widened): the
/// reference an adapter run must equal.
fn merged_file(src: &Path, dst: &Path, deltas: &[Delta]) {
    use nibble_tests::build::{build_file, f32_entry, RawEntry};
    let base = ModelIndex::open(src).expect("model");
    let weight = |m: &str| format!("{m}.weight");
    let q4: Vec<&str> = deltas
        .iter()
        .map(|d| d.0.as_str())
        .filter(|m| base.q4_key(&weight(m)).expect("keys").is_some())
        .collect();
    let deq_path = dst.with_extension("deq.safetensors");
    let deq = (!q4.is_empty()).then(|| {
        let mut args: Vec<String> = vec!["dequant".into(), src.display().to_string()];
        for m in &q4 {
            args.extend(["--tensor".into(), weight(m)]);
        }
        args.extend(["-o".into(), deq_path.display().to_string()]);
        let o = nibble(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        ModelIndex::open(&deq_path).expect("dequantized")
    });
    let owned = |name: &str| {
        deltas
            .iter()
            .any(|(m, ..)| name.starts_with(&weight(m)) || name == format!("{m}.bias"))
    };
    let mut tensors: Vec<RawEntry> = base
        .tensors()
        .filter(|t| !owned(&t.name))
        .map(|t| {
            let dtype = nibble_core::format::dtype::dtype_name(t.dtype);
            (
                t.name.clone(),
                dtype,
                t.shape.clone(),
                base.read_bytes(t).expect("read"),
            )
        })
        .collect();
    for (m, dw, db) in deltas {
        let (shape, w) = match deq.as_ref().and_then(|d| d.get(&weight(m)).map(|e| (d, e))) {
            Some((d, e)) => (
                base.quant_state_json(base.q4_key(&weight(m)).expect("k").expect("q4"))
                    .expect("state")
                    .shape
                    .to_vec(),
                d.read_f32(e).expect("deq"),
            ),
            None => {
                let e = base.require(&weight(m)).expect("weight");
                (e.shape.clone(), base.read_f32(e).expect("w"))
            }
        };
        assert_eq!(w.len(), dw.len(), "{m}");
        let w: Vec<f32> = w.iter().zip(dw).map(|(a, b)| a + b).collect();
        tensors.push(f32_entry(&weight(m), &shape, &w));
        let b = base
            .get(&format!("{m}.bias"))
            .map(|e| base.read_f32(e).expect("bias"));
        let b = match (b, db) {
            (Some(b), Some(d)) => Some(b.iter().zip(d).map(|(a, x)| a + x).collect()),
            (None, Some(d)) => Some(d.clone()),
            (b, None) => b,
        };
        if let Some(b) = b {
            tensors.push(f32_entry(&format!("{m}.bias"), &[b.len() as u64], &b));
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    build_file(dst, &tensors);
    let _ = std::fs::remove_file(&deq_path);
}

/// `n` seeded values in [-k, k).
fn small_values(n: usize, seed: u64, k: f32) -> Vec<f32> {
    nibble_tests::build::random_values(n, seed)
        .iter()
        .map(|v| v * k)
        .collect()
}

/// `k · up · down` for `up` `[out, r]` and `down` `[r, inp]`, row-major `[out, inp]`.
fn low_rank_delta(
    up: &[f32],
    down: &[f32],
    (out, r, inp): (usize, usize, usize),
    k: f32,
) -> Vec<f32> {
    (0..out * inp)
        .map(|j| {
            let (o, c) = (j / inp, j % inp);
            k * (0..r)
                .map(|q| up[o * r + q] * down[q * inp + c])
                .sum::<f32>()
        })
        .collect()
}

/// `[out, in]` of `module` in `m` (4-bit or dense; a Conv3d flattened).
fn linear_shape(m: &ModelIndex, module: &str) -> (Vec<u64>, usize, usize) {
    let name = format!("{module}.weight");
    let shape = match m.q4_key(&name).expect("keys") {
        Some(k) => m.quant_state_json(k).expect("state").shape.to_vec(),
        None => m.require(&name).expect("weight").shape.clone(),
    };
    let (out, inp) = (
        shape[0] as usize,
        shape[1..].iter().product::<u64>() as usize,
    );
    (shape, out, inp)
}

/// A Wan LoRA as the trainers built on Wan's own code write it (`diffusion_model.` + Wan's module
/// names, `lora_down`/`lora_up`, `.alpha`, `.diff_b` bias deltas, a `.diff` full-weight delta, a
/// zeroed norm delta) and as
/// musubi-tuner writes it (`lora_unet_blocks_0_self_attn_q`), on the tiny Wan pipeline at scale
/// 0.5: the final latents and the video equal those of the same pipeline whose adapted weights
/// and biases were merged in f32 (`W + 0.5 · alpha/r · up·down (+ 0.5 · diff)`,
/// `b + 0.5 · diff_b`), within
/// 1e-4 x max, and differ from the base's. The Conv3d patch embedding's pair is flattened as
/// its linear is.
#[test]
fn wan_adapters_equal_their_merged_weights() {
    use nibble_tests::build::{build_file, f32_entry, RawEntry};
    let src = shared("tiny-wan-pipeline/pipeline");
    let file = src.join("transformer/diffusion_pytorch_model.safetensors");
    let base = ModelIndex::open(&file).expect("transformer");
    let tmp = tempfile::tempdir().expect("tmp");
    // (Wan's name, diffusers' module, rank, with a bias delta)
    let mods = [
        ("blocks.0.self_attn.q", "blocks.0.attn1.to_q", 4, true),
        ("blocks.1.cross_attn.o", "blocks.1.attn2.to_out.0", 2, false),
        ("blocks.0.ffn.2", "blocks.0.ffn.net.2", 4, true),
        ("time_projection.1", "condition_embedder.time_proj", 3, true),
        ("head.head", "proj_out", 2, false),
        ("patch_embedding", "patch_embedding", 2, false),
    ];
    let scale = 0.5f32;
    let (mut wan, mut musubi, mut deltas) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (orig, m, r, with_bias)) in mods.into_iter().enumerate() {
        let (ws, out, inp) = linear_shape(&base, m);
        let down: Vec<f32> = small_values(r * inp, 10 + i as u64, 0.3);
        let up: Vec<f32> = small_values(out * r, 20 + i as u64, 0.3);
        let alpha = 2.0 * r as f32;
        let bias: Vec<f32> = small_values(out, 30 + i as u64, 0.1);
        // Conv3d halves keep their trailing dims, as the trainers save them.
        let (dshape, ushape): (Vec<u64>, Vec<u64>) = if ws.len() > 2 {
            let mut d = vec![r as u64];
            d.extend(&ws[1..]);
            (d, vec![out as u64, r as u64, 1, 1, 1])
        } else {
            (vec![r as u64, inp as u64], vec![out as u64, r as u64])
        };
        let kohya = format!("lora_unet_{}", orig.replace('.', "_"));
        for (list, pre) in [
            (&mut wan, format!("diffusion_model.{orig}")),
            (&mut musubi, kohya),
        ] {
            list.push(f32_entry(
                &format!("{pre}.lora_down.weight"),
                &dshape,
                &down,
            ));
            list.push(f32_entry(&format!("{pre}.lora_up.weight"), &ushape, &up));
            list.push(f32_entry(&format!("{pre}.alpha"), &[], &[alpha]));
        }
        if with_bias {
            wan.push(f32_entry(
                &format!("diffusion_model.{orig}.diff_b"),
                &[out as u64],
                &bias,
            ));
        }
        let dw = low_rank_delta(&up, &down, (out, r, inp), scale * alpha / r as f32);
        let db = with_bias.then(|| bias.iter().map(|b| scale * b).collect());
        deltas.push((m.to_string(), dw, db));
    }
    wan.push(f32_entry(
        "diffusion_model.blocks.0.norm3.diff",
        &[32],
        &[0.0; 32],
    ));
    // A full-weight delta on a linear of its own: `W + 0.5 · diff`.
    let (_, out, inp) = linear_shape(&base, "blocks.1.ffn.net.0.proj");
    let diff: Vec<f32> = small_values(out * inp, 60, 0.05);
    wan.push(f32_entry(
        "diffusion_model.blocks.1.ffn.0.diff",
        &[out as u64, inp as u64],
        &diff,
    ));
    deltas.push((
        "blocks.1.ffn.net.0.proj".to_string(),
        diff.iter().map(|d| scale * d).collect(),
        None,
    ));
    build_file(&tmp.path().join("wan_lora.safetensors"), &wan);
    build_file(&tmp.path().join("musubi_lora.safetensors"), &musubi);
    let merged = tmp.path().join("merged");
    nibble_tests::copy_dir(&src, &merged);
    merged_file(
        &file,
        &merged.join("transformer/diffusion_pytorch_model.safetensors"),
        &deltas,
    );
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(shared("tiny-wan-pipeline/manifest.json")).expect("manifest"),
    )
    .expect("json");
    let run = |model: &Path, lora: Option<&Path>, tag: &str| -> ModelIndex {
        let (r, p) = (&manifest["run"], &manifest["prompts"][0]);
        let s = |v: &serde_json::Value| v.to_string();
        let inter = tmp.path().join(format!("{tag}.safetensors"));
        let mut args: Vec<String> = vec![
            "run".into(),
            "--model".into(),
            model.display().to_string(),
            "--prompt".into(),
            p["text"].as_str().expect("text").into(),
            "--height".into(),
            s(&r["height"]),
            "--width".into(),
            s(&r["width"]),
            "--frames".into(),
            s(&r["num_frames"]),
            "--steps".into(),
            s(&r["num_inference_steps"]),
            "--max-sequence-length".into(),
            s(&r["max_sequence_length"]),
            "--seed".into(),
            s(&p["generator_seed"]),
            "--out".into(),
            tmp.path().join(format!("{tag}.mp4")).display().to_string(),
            "--intermediates".into(),
            inter.display().to_string(),
            "--backend".into(),
            "cpu".into(),
        ];
        if let Some(l) = lora {
            args.extend(["--lora".into(), format!("{}:{scale}", l.display())]);
        }
        let o = nibble(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{tag}: {err}");
        if lora.is_some() {
            let n = if tag == "wan" {
                mods.len() + 1
            } else {
                mods.len()
            };
            assert!(err.contains(&format!("{n} linears")), "{tag}: {err}");
        }
        ModelIndex::open(&inter).expect("intermediates")
    };
    let want = run(&merged, None, "merged");
    let plain = run(&src, None, "base");
    let got = run(&src, Some(&tmp.path().join("wan_lora.safetensors")), "wan");
    for n in ["final_latents", "video_f32"] {
        let e = rel(&f32s(&got, n), &f32s(&want, n));
        assert!(
            e <= 1e-4,
            "{n}: error {e:e} x max against the merged weights"
        );
        let moved = rel(&f32s(&plain, n), &f32s(&want, n));
        println!("{n}: {e:e} x max from the merged weights; the base is {moved:e} x max away");
        assert!(moved > 1e-3, "the adapter moves {n} ({moved:e} x max)");
    }
    // musubi's naming binds the same pairs (no bias deltas): the Wan file without its deltas
    // gives the same video bit for bit.
    let no_bias: Vec<RawEntry> = wan
        .iter()
        .filter(|t| !t.0.ends_with(".diff_b") && !t.0.ends_with(".diff"))
        .cloned()
        .collect();
    build_file(&tmp.path().join("wan_nobias.safetensors"), &no_bias);
    let a = run(
        &src,
        Some(&tmp.path().join("wan_nobias.safetensors")),
        "nobias",
    );
    let b = run(
        &src,
        Some(&tmp.path().join("musubi_lora.safetensors")),
        "musubi",
    );
    assert_eq!(
        f32s(&a, "video_f32"),
        f32s(&b, "video_f32"),
        "musubi's names bind the same pairs"
    );
}

/// One LoRA file for a whole Flux pipeline: the transformer, CLIP (dense bf16) and T5 (4-bit),
/// in diffusers' naming (`transformer.`, `text_encoder.`, `text_encoder_2.`) and in kohya's
/// (`lora_unet_`, `lora_te1_`, `lora_te2_` with `.alpha`), and with the transformer's keys
/// unprefixed: at scale 0.6 the text embeddings, the
/// final latents and the image equal those of the pipeline with the deltas merged into f32
/// weights (within 1e-4 x max) and differ from the base's; the embedding cache keys the
/// adapters, so a cached run without them does not reuse the adapted embeddings.
#[test]
fn flux_adapters_reach_the_text_encoders() {
    use nibble_tests::build::{build_file, f32_entry};
    let src = shared("tiny-flux-pipeline/pipeline");
    let tmp = tempfile::tempdir().expect("tmp");
    // (component, module, kohya name, rank)
    let mods = [
        (
            "transformer",
            "transformer_blocks.0.attn.to_out.0",
            "lora_unet_double_blocks_0_img_attn_proj",
            4,
        ),
        (
            "text_encoder",
            "text_model.encoder.layers.0.self_attn.q_proj",
            "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
            2,
        ),
        (
            "text_encoder",
            "text_model.encoder.layers.1.mlp.fc2",
            "lora_te1_text_model_encoder_layers_1_mlp_fc2",
            3,
        ),
        (
            "text_encoder_2",
            "encoder.block.0.layer.0.SelfAttention.q",
            "lora_te2_encoder_block_0_layer_0_SelfAttention_q",
            2,
        ),
        (
            "text_encoder_2",
            "encoder.block.1.layer.1.DenseReluDense.wo",
            "lora_te2_encoder_block_1_layer_1_DenseReluDense_wo",
            2,
        ),
    ];
    let file_of = |c: &str| {
        let d = src.join(c);
        ["model.safetensors", "diffusion_pytorch_model.safetensors"]
            .iter()
            .map(|f| d.join(f))
            .find(|p| p.is_file())
            .expect("a weights file")
    };
    let scale = 0.6f32;
    let (mut diffusers, mut kohya, mut unprefixed) = (Vec::new(), Vec::new(), Vec::new());
    let mut deltas: std::collections::BTreeMap<&str, Vec<Delta>> = Default::default();
    for (i, (c, m, k, r)) in mods.into_iter().enumerate() {
        let base = ModelIndex::open(&file_of(c)).expect("component");
        let (_, out, inp) = linear_shape(&base, m);
        let down: Vec<f32> = small_values(r * inp, 40 + i as u64, 0.4);
        let up: Vec<f32> = small_values(out * r, 50 + i as u64, 0.4);
        // The pair under one naming: the down projection, then the up projection.
        let pair = |v: &mut Vec<_>, a: String, b: String| {
            v.push(f32_entry(&a, &[r as u64, inp as u64], &down));
            v.push(f32_entry(&b, &[out as u64, r as u64], &up));
        };
        pair(
            &mut diffusers,
            format!("{c}.{m}.lora_A.weight"),
            format!("{c}.{m}.lora_B.weight"),
        );
        // The transformer's keys without their component (as peft saves a transformer alone).
        let pre = if c == "transformer" {
            m.to_string()
        } else {
            format!("{c}.{m}")
        };
        pair(
            &mut unprefixed,
            format!("{pre}.lora_A.weight"),
            format!("{pre}.lora_B.weight"),
        );
        pair(
            &mut kohya,
            format!("{k}.lora_down.weight"),
            format!("{k}.lora_up.weight"),
        );
        // alpha = r: scaling 1, as diffusers reads the file without metadata.
        kohya.push(f32_entry(&format!("{k}.alpha"), &[], &[r as f32]));
        let dw = low_rank_delta(&up, &down, (out, r, inp), scale);
        deltas.entry(c).or_default().push((m.to_string(), dw, None));
    }
    build_file(&tmp.path().join("diffusers.safetensors"), &diffusers);
    build_file(&tmp.path().join("kohya.safetensors"), &kohya);
    build_file(&tmp.path().join("unprefixed.safetensors"), &unprefixed);
    let merged = tmp.path().join("merged");
    nibble_tests::copy_dir(&src, &merged);
    for (c, d) in &deltas {
        let f = file_of(c);
        merged_file(&f, &merged.join(c).join(f.file_name().expect("name")), d);
    }
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(shared("tiny-flux-pipeline/lora/manifest.json")).expect("manifest"),
    )
    .expect("json");
    let cache = tmp.path().join("cache");
    let run = |model: &Path, lora: Option<&str>, tag: &str, cached: bool| -> ModelIndex {
        let r = &manifest["run"];
        let num = |k: &str| r[k].as_u64().expect(k).to_string();
        let inter = tmp.path().join(format!("{tag}.safetensors"));
        let mut args: Vec<String> = vec![
            "run".into(),
            "--model".into(),
            model.display().to_string(),
            "--prompt".into(),
            r["prompt"].as_str().expect("prompt").into(),
            "--height".into(),
            num("height"),
            "--width".into(),
            num("width"),
            "--steps".into(),
            num("num_inference_steps"),
            "--max-sequence-length".into(),
            num("max_sequence_length"),
            "--seed".into(),
            num("generator_seed"),
            "--out".into(),
            tmp.path().join(format!("{tag}.png")).display().to_string(),
            "--intermediates".into(),
            inter.display().to_string(),
            "--backend".into(),
            "cpu".into(),
            "--json".into(),
        ];
        if cached {
            args.extend(["--embed-cache".into(), cache.display().to_string()]);
        }
        if let Some(l) = lora {
            args.extend([
                "--lora".into(),
                format!("{}:{scale}", tmp.path().join(l).display()),
            ]);
        }
        let o = nibble(&args);
        assert!(
            o.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        ModelIndex::open(&inter).expect("intermediates")
    };
    let want = run(&merged, None, "merged", false);
    let plain = run(&src, None, "base", true);
    for file in [
        "diffusers.safetensors",
        "kohya.safetensors",
        "unprefixed.safetensors",
    ] {
        let got = run(&src, Some(file), file, true);
        for n in [
            "pooled_prompt_embeds",
            "prompt_embeds",
            "final_latents_packed",
            "image_f32",
        ] {
            let e = rel(&f32s(&got, n), &f32s(&want, n));
            let moved = rel(&f32s(&plain, n), &f32s(&want, n));
            println!("{file} {n}: {e:e} x max from the merged weights, the base {moved:e} away");
            assert!(
                e <= 1e-4,
                "{file}: {n} error {e:e} x max against the merged weights"
            );
            assert!(
                moved > 1e-3,
                "{file}: the adapters move {n} ({moved:e} x max)"
            );
        }
    }
    // The base again through the cache the adapted runs wrote to: its own embeddings.
    let again = run(&src, None, "again", true);
    assert_eq!(f32s(&again, "prompt_embeds"), f32s(&plain, "prompt_embeds"));
}
