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

fn f32s(m: &ModelIndex, name: &str) -> Vec<f32> {
    m.read_f32(m.require(name).unwrap_or_else(|e| panic!("{name}: {e}")))
        .expect("read")
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs())) as f64;
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() as f64)
        .fold(0.0, f64::max)
        / m.max(1e-30)
}

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
    let o = nibble(&[
        "run".into(),
        "--model".into(),
        shared("tiny-llama-nf4/model").display().to_string(),
        "--prompt-ids".into(),
        "1,2".into(),
        "--lora".into(),
        shared("tiny-flux-pipeline/lora/kohya/lora_kohya.safetensors")
            .display()
            .to_string(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("lora_unet_") && err.contains("kohya"), "{err}");
    let o = nibble(&[
        "run".into(),
        "--model".into(),
        shared("tiny-llama-nf4/model").display().to_string(),
        "--prompt-ids".into(),
        "1,2".into(),
        "--lora".into(),
        shared("tiny-flux-pipeline/lora/diffusers/pytorch_lora_weights.safetensors")
            .display()
            .to_string(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("transformer."), "names the key: {err}");
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
