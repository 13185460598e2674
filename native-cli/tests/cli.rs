//! The `nibble` binary as a user runs it: inspect, dequant, quantize, and bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nibble_tests::read_json;

fn nibble(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .output()
        .expect("run nibble")
}

fn fixtures() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures");
    assert!(
        p.join("manifest.json").is_file(),
        "shared fixtures missing at {}",
        p.display()
    );
    p
}

/// What a fixture's manifest says of its 4-bit weights: the quantized linears in order and the
/// quant state of each (`quant_type`, `blocksize`, `dtype`, `shape`, `nested_*`).
struct Quantized {
    names: Vec<String>,
    deq: serde_json::Value,
}

impl Quantized {
    fn of(fixture: &str) -> Self {
        let m = read_json(&fixtures().join(fixture).join("manifest.json"));
        let names = m["quantized_linears"]
            .as_array()
            .expect("quantized_linears")
            .iter()
            .map(|v| v.as_str().expect("name").to_string())
            .collect();
        Quantized {
            names,
            deq: m["dequantized_weights"].clone(),
        }
    }

    fn state(&self, name: &str) -> &serde_json::Value {
        let s = &self.deq[name]["quant_state"];
        assert!(s.is_object(), "manifest: no quant state for {name}");
        s
    }
}

/// Bytes of the `*.safetensors` files of a model folder.
fn safetensors_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("model folder")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().expect("metadata").len())
        .sum()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn inspect_json_lists_tensors_quant_state_totals_and_config() {
    let model = fixtures().join("tiny-llama-nf4/model");
    let o = nibble(&["inspect", model.to_str().expect("utf8"), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let index = nibble_core::io::model::ModelIndex::open(&model).expect("fixture");
    let want = Quantized::of("tiny-llama-nf4");
    let config = read_json(&model.join("config.json"));
    assert_eq!(v["tensors"].as_array().expect("tensors").len(), index.len());
    let q = v["quantized"].as_array().expect("quantized");
    assert_eq!(q.len(), want.names.len());
    for name in &want.names {
        let w = q
            .iter()
            .find(|w| w["name"] == name.as_str())
            .unwrap_or_else(|| panic!("{name} listed"));
        let s = want.state(name);
        assert_eq!(w["quant_type"], s["quant_type"], "{name}");
        assert_eq!(w["blocksize"], s["blocksize"], "{name}");
        assert_eq!(
            w["double_quant"],
            s["nested_blocksize"].is_number(),
            "{name}"
        );
        assert_eq!(w["shape"], s["shape"], "{name}");
        assert_eq!(w["dtype"], s["dtype"], "{name}");
    }
    assert_eq!(v["totals"]["file_bytes"], safetensors_bytes(&model));
    assert_eq!(v["totals"]["quantized_weights"], want.names.len());
    assert_eq!(v["config"]["hidden_size"], config["hidden_size"]);
    assert_eq!(
        v["quantization_config"]["bnb_4bit_quant_type"],
        config["quantization_config"]["bnb_4bit_quant_type"]
    );
}

#[test]
fn inspect_text_groups_4bit_weights() {
    let model = fixtures().join("tiny-dit-nf4/model");
    let o = nibble(&["inspect", model.to_str().expect("utf8")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let want = Quantized::of("tiny-dit-nf4");
    for name in &want.names {
        let s = want.state(name);
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name.as_str()))
            .unwrap_or_else(|| panic!("{name} in\n{out}"));
        let detail = format!(
            "{} blocksize {}{} {}",
            s["quant_type"].as_str().expect("quant_type"),
            s["blocksize"],
            if s["nested_blocksize"].is_number() {
                " double-quant"
            } else {
                ""
            },
            s["dtype"].as_str().expect("dtype")
        );
        assert!(line.contains(&detail), "{name}: {detail:?} in {line:?}");
    }
    assert!(out.contains("quantization_config: "), "{out}");
    assert!(out.contains("totals: "), "{out}");
}

#[test]
fn dequant_all_writes_f32_weights_equal_to_bitsandbytes() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("deq.safetensors");
    let model = fixtures().join("tiny-llama-nf4/model");
    let o = nibble(&[
        "dequant",
        model.to_str().expect("utf8"),
        "--all",
        "-o",
        out.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = nibble_core::io::model::ModelIndex::open(&out).expect("output is valid safetensors");
    let want = nibble_core::io::model::ModelIndex::open(
        &fixtures().join("tiny-llama-nf4/expected.safetensors"),
    )
    .expect("expected");
    assert_eq!(got.len(), Quantized::of("tiny-llama-nf4").names.len());
    for t in got.tensors() {
        assert_eq!(t.dtype, nibble_core::format::dtype::Dtype::F32);
        let w = want
            .require(&format!("deq.{}", t.name))
            .expect("expected deq");
        assert_eq!(t.shape, w.shape, "{} logical shape", t.name);
        let g = got.read_f32(t).expect("read");
        let e = want.read_f32(w).expect("read");
        assert!(g.iter().zip(&e).all(|(a, b)| a == b), "{} differs", t.name);
    }
}

#[test]
fn dequant_one_tensor_and_refuse_a_plain_one() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("one.safetensors");
    let model = fixtures().join("tiny-llama-nf4/model");
    let m = model.to_str().expect("utf8");
    let want = Quantized::of("tiny-llama-nf4");
    let name = want.names.last().expect("a quantized linear");
    let o = nibble(&[
        "dequant",
        m,
        "--tensor",
        name,
        "-o",
        out.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = nibble_core::io::model::ModelIndex::open(&out).expect("valid");
    let shape: Vec<u64> = want.state(name)["shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dim"))
        .collect();
    assert_eq!(got.len(), 1);
    assert_eq!(got.require(name).expect("t").shape, shape);

    let o = nibble(&[
        "dequant",
        m,
        "--tensor",
        "lm_head.weight",
        "-o",
        out.to_str().expect("utf8"),
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not a bitsandbytes 4-bit weight"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn quantize_then_inspect_and_dequantize() {
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("dense.safetensors");
    let values: Vec<f32> = (0..96 * 40)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let bias: Vec<f32> = (0..96).map(|i| i as f32).collect();
    nibble_core::format::writer::write_safetensors(
        &src,
        &[
            (
                "layer.weight".into(),
                nibble_core::format::dtype::Dtype::F32,
                vec![96, 40],
                nibble_core::format::dtype::f32_to_bytes(&values),
            ),
            (
                "layer.bias".into(),
                nibble_core::format::dtype::Dtype::F32,
                vec![96],
                nibble_core::format::dtype::f32_to_bytes(&bias),
            ),
            (
                "embed_tokens.weight".into(),
                nibble_core::format::dtype::Dtype::F32,
                vec![96, 40],
                nibble_core::format::dtype::f32_to_bytes(&values),
            ),
        ],
        &Default::default(),
    )
    .expect("write");
    let q = dir.path().join("q.safetensors");
    let o = nibble(&[
        "quantize",
        src.to_str().expect("utf8"),
        "-o",
        q.to_str().expect("utf8"),
        "--quant",
        "fp4",
        "--blocksize",
        "128",
        "--double-quant",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = nibble_core::io::model::ModelIndex::open(&q).expect("valid output");
    let ws = m.q4_weights().map(<[_]>::to_vec).expect("find");
    assert_eq!(
        ws.len(),
        1,
        "only layer.weight is quantized (embeddings excluded by default)"
    );
    let s = m.quant_state(&ws[0]).expect("state");
    assert_eq!(s.json.quant_type, nibble_core::format::bnb::QuantType::Fp4);
    assert_eq!(s.json.blocksize, 128);
    assert!(s.json.nested.is_some());
    // Copied tensors are byte-identical.
    let b = m
        .read_f32(m.require("layer.bias").expect("bias"))
        .expect("read");
    assert_eq!(b, bias);
    assert_eq!(
        m.require("embed_tokens.weight").expect("embed").dtype,
        nibble_core::format::dtype::Dtype::F32
    );
}

#[test]
fn bad_input_is_one_clear_line_and_no_panic() {
    let dir = tempfile::tempdir().expect("tmp");
    let bad = dir.path().join("bad.safetensors");
    let mut bytes = 40u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(br#"{"t": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}"#);
    std::fs::write(&bad, &bytes).expect("write");
    for args in [
        vec!["inspect", bad.to_str().expect("utf8")],
        vec!["inspect", "/nonexistent/model"],
        vec![
            "dequant",
            bad.to_str().expect("utf8"),
            "--all",
            "-o",
            "/tmp/never.safetensors",
        ],
        vec![
            "quantize",
            bad.to_str().expect("utf8"),
            "-o",
            "/tmp/never.safetensors",
        ],
    ] {
        let o = nibble(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: one line expected, got {err}"
        );
        assert!(err.starts_with("error: "), "{err}");
    }
    let o = nibble(&["inspect", bad.to_str().expect("utf8")]);
    assert!(
        stderr(&o).contains("bad.safetensors"),
        "names the file: {}",
        stderr(&o)
    );
}

#[test]
fn synth_then_bench_stream_json() {
    let dir = tempfile::tempdir().expect("tmp");
    let m = dir.path().join("dit");
    let o = nibble(&[
        "synth",
        "--arch",
        "dit",
        "--size",
        "24MiB",
        "--seed",
        "3",
        "-o",
        m.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(cfg["_class_name"], "FluxTransformer2DModel");
    assert_eq!(cfg["quantization_config"]["quant_method"], "bitsandbytes");
    // Same seed, same bytes.
    let m2 = dir.path().join("dit2");
    assert!(nibble(&[
        "synth",
        "--arch",
        "dit",
        "--size",
        "24MiB",
        "--seed",
        "3",
        "-o",
        m2.to_str().expect("utf8")
    ])
    .status
    .success());
    let f = "diffusion_pytorch_model.safetensors";
    assert_eq!(
        std::fs::read(m.join(f)).expect("a"),
        std::fs::read(m2.join(f)).expect("b")
    );
    let idx = nibble_core::io::model::ModelIndex::open(&m).expect("valid diffusers folder");
    let ws = idx.q4_weights().map(<[_]>::to_vec).expect("4-bit weights");
    assert!(ws
        .iter()
        .any(|k| k.base == "transformer_blocks.0.attn.to_q.weight"));
    assert!(ws
        .iter()
        .any(|k| k.base == "single_transformer_blocks.0.proj_out.weight"));
    for k in ws.iter().take(5) {
        let s = idx.quant_state(k).expect("valid quant state");
        assert!(s.absmax.iter().all(|a| *a > 0.0));
    }

    let o = nibble(&[
        "bench",
        "stream",
        "--model",
        m.to_str().expect("utf8"),
        "--slots",
        "3",
        "--slot-size",
        "1MiB",
        "--steps",
        "4",
        "--consume-ms-per-mib",
        "0.5",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let steps = v["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 4);
    for s in steps {
        for k in ["wall_ms", "bytes", "stall_ms", "rss_bytes"] {
            assert!(s[k].is_number(), "{k} in {s}");
        }
        assert_eq!(
            s["bytes"].as_u64(),
            Some(idx.tensors().map(|t| t.len).sum::<u64>())
        );
    }
    for k in [
        "throughput_mib_s",
        "baseline_mib_s",
        "ratio",
        "rss_first_bytes",
        "rss_last_bytes",
        "rss_max_bytes",
        "overlap_efficiency",
    ] {
        assert!(v["summary"][k].is_number(), "summary.{k}");
    }
}

#[test]
fn inspect_url_fetches_only_headers() {
    use nibble_tests::http_server::{Fault, TestServer};
    let dir = fixtures().join("tiny-llama-nf4/model");
    let mut files = std::collections::HashMap::new();
    for f in ["config.json", "model.safetensors"] {
        files.insert(
            format!("m/{f}"),
            std::fs::read(dir.join(f)).expect("fixture"),
        );
    }
    let model = files["m/model.safetensors"].clone();
    let header_len = u64::from_le_bytes(model[..8].try_into().expect("8 bytes"));
    let srv = TestServer::start(files, Fault::None);
    let o = nibble(&["inspect", &format!("{}/m", srv.base), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let index = nibble_core::io::model::ModelIndex::open(&dir).expect("fixture");
    let want = Quantized::of("tiny-llama-nf4");
    let config = read_json(&dir.join("config.json"));
    assert_eq!(v["tensors"].as_array().expect("t").len(), index.len());
    assert_eq!(
        v["quantized"].as_array().expect("q").len(),
        want.names.len()
    );
    assert_eq!(
        v["quantization_config"]["bnb_4bit_quant_type"],
        config["quantization_config"]["bnb_4bit_quant_type"]
    );
    let st = srv.stats();
    assert_eq!(
        st.bytes_by_path["m/model.safetensors"],
        8 + header_len,
        "only the header of the weights"
    );
    assert_eq!(st.ranges.len(), 2);

    // With --quant-state the small quant-state tensors come too, and the details appear.
    let o = nibble(&[
        "inspect",
        &format!("{}/m", srv.base),
        "--json",
        "--quant-state",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let q = &v["quantized"][0];
    let name = q["name"].as_str().expect("name");
    assert_eq!(q["blocksize"], want.state(name)["blocksize"], "{name}");
    assert_eq!(q["quant_state_fetched"], true);
}

/// #34 part 1 (CPU): `bench kernels` measures the machine's peaks first and places every kernel
/// under the roof it is bound by, with the fraction of that roof it reaches.
#[test]
fn run_generates_the_fixture_greedy_tokens_and_writes_logits() {
    let dir = fixtures().join("tiny-llama-nf4");
    let exp = nibble_core::io::model::ModelIndex::open(&dir.join("expected.safetensors"))
        .expect("expected");
    let ints = |name: &str| -> Vec<i64> {
        let b = exp
            .read_bytes(exp.require(name).expect(name))
            .expect("read");
        b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
            .collect()
    };
    let prompt: Vec<String> = ints("prompt_ids").iter().map(|i| i.to_string()).collect();
    let want: Vec<i64> = ints("greedy_tokens_deq");
    let tmp = tempfile::tempdir().expect("tmp");
    let logits = tmp.path().join("logits.safetensors");
    let model = dir.join("model");
    let o = nibble(&[
        "run",
        "--model",
        model.to_str().expect("utf8"),
        "--prompt-ids",
        &prompt.join(","),
        "--max-tokens",
        &want.len().to_string(),
        "--backend",
        "cpu",
        "--json",
        "--logits-out",
        logits.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let got: Vec<i64> = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(|t| t.as_i64())
        .collect();
    assert_eq!(got, want, "greedy tokens");
    for k in [
        "prefill_tok_s",
        "decode_tok_s",
        "rss_max_bytes",
        "bytes_streamed",
    ] {
        assert!(v[k].is_number(), "{k}");
    }
    let l = nibble_core::io::model::ModelIndex::open(&logits).expect("logits file");
    let vocab = read_json(&model.join("config.json"))["vocab_size"]
        .as_u64()
        .expect("vocab_size");
    assert_eq!(
        l.require("logits").expect("logits").shape,
        vec![prompt.len() as u64, vocab]
    );
    assert_eq!(
        l.require("step_logits").expect("step").shape,
        vec![want.len() as u64, vocab]
    );
    let got = l.read_f32(l.require("logits").expect("l")).expect("read");
    let want = exp
        .read_f32(exp.require("logits_deq_all").expect("w"))
        .expect("read");
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = got
        .iter()
        .zip(&want)
        .fold(0f32, |a, (g, w)| a.max((g - w).abs()));
    assert!(e <= 1e-5 * m, "prompt logits error {e} vs max {m}");
}

#[test]
fn run_denoises_the_fixture_dit_like_diffusers_euler() {
    let dir = fixtures().join("tiny-dit-nf4");
    let exp = nibble_core::io::model::ModelIndex::open(&dir.join("expected.safetensors"))
        .expect("expected");
    let f = |n: &str| exp.read_f32(exp.require(n).expect(n)).expect("read");
    let tmp = tempfile::tempdir().expect("tmp");
    let inputs = tmp.path().join("inputs.safetensors");
    let t = |name: &str, src: &str| {
        let e = exp.require(src).expect(src);
        (
            name.to_string(),
            e.dtype,
            e.shape.clone(),
            exp.read_bytes(e).expect("read"),
        )
    };
    let mut named = vec![
        t("hidden_states", "euler_x0"),
        t("encoder_hidden_states", "encoder_hidden_states"),
        t("pooled_projections", "pooled_projections"),
        t("img_ids", "img_ids"),
        t("txt_ids", "txt_ids"),
    ];
    // Only a model with a guidance embedding has (and reads) one.
    if exp.get("guidance").is_some() {
        named.push(t("guidance", "guidance"));
    }
    nibble_core::format::writer::write_safetensors(&inputs, &named, &Default::default())
        .expect("inputs");
    let n_steps = f("euler_sigmas").len() - 1;
    let out = tmp.path().join("latent.safetensors");
    let png = tmp.path().join("preview.png");
    let o = nibble(&[
        "run",
        "--model",
        dir.join("model").to_str().expect("utf8"),
        "--steps",
        &n_steps.to_string(),
        "--inputs",
        inputs.to_str().expect("utf8"),
        "--backend",
        "cpu",
        "--out",
        out.to_str().expect("utf8"),
        "--preview",
        png.to_str().expect("utf8"),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let steps = v["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), n_steps);
    for s in steps {
        for k in ["step", "wall_ms", "bytes_streamed", "stall_ms", "rss_bytes"] {
            assert!(s[k].is_number(), "{k} in {s}");
        }
    }
    let l = nibble_core::io::model::ModelIndex::open(&out).expect("latent file");
    let got = l
        .read_f32(l.require("latent").expect("latent"))
        .expect("read");
    let want = f("euler_final");
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = got
        .iter()
        .zip(&want)
        .fold(0f32, |a, (g, w)| a.max((g - w).abs()));
    assert!(e <= 2e-5 * m, "final latent error {e} vs max {m}");
    let header = std::fs::read(&png).expect("png");
    assert_eq!(&header[..8], b"\x89PNG\r\n\x1a\n");
}

/// `nibble run` on a BERT encoder: the prompt's sentence embedding, pooled and normalized as the
/// model's sentence-transformers files say, equal to the fixture's (atol 2e-5), with every
/// layer streamed through a small budget.
#[test]
fn run_embeds_a_sentence_like_sentence_transformers() {
    let dir = fixtures().join("minilm-nf4");
    let manifest = read_json(&dir.join("manifest.json"));
    let sentence = manifest["sentences"][0].as_str().expect("a sentence");
    let exp = nibble_core::io::model::ModelIndex::open(&dir.join("expected.safetensors"))
        .expect("expected");
    let e = exp.require("emb_nf4_deq_fp32").expect("embeddings");
    let hidden = *e.shape.last().expect("shape") as usize;
    let want = &exp.read_f32(e).expect("read")[..hidden];
    let model = dir.join("model");
    let o = nibble(&[
        "run",
        "--model",
        model.to_str().expect("utf8"),
        "--prompt",
        sentence,
        "--backend",
        "cpu",
        "--stream-all",
        "--device-budget",
        "64MiB",
        "--slots",
        "2",
        "--slot-size",
        "256KiB",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let got: Vec<f32> = v["embedding"]
        .as_array()
        .expect("embedding")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect();
    assert_eq!(got.len(), hidden);
    let err = nibble_tests::max_abs_err(&got, want);
    assert!(err <= 2e-5, "sentence embedding error {err}");
    assert_eq!(v["plan"]["resident_groups"], 0, "{}", v["plan"]);
    assert!(v["bytes_streamed"].as_u64().expect("bytes") > 0);
    assert_eq!(v["normalized"], true);

    // A model of no kind nibble runs is refused in one line.
    let tmp = tempfile::tempdir().expect("tmp");
    std::fs::copy(
        model.join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .expect("copy");
    std::fs::write(
        tmp.path().join("config.json"),
        r#"{"model_type": "t5", "architectures": ["T5EncoderModel"]}"#,
    )
    .expect("config");
    let o = nibble(&[
        "run",
        "--model",
        tmp.path().to_str().expect("utf8"),
        "--prompt",
        "x",
        "--backend",
        "cpu",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("neither a Llama-family decoder, a Flux-style DiT nor a BERT encoder"),
        "{}",
        stderr(&o)
    );
}

/// Fault classes 6, 7 and 13 at the command line: absurd sizes, counts, empty shapes and
/// non-finite numbers end with exit code 1 and a message, quickly, before anything large is
/// allocated; never a panic or an abort.
#[test]
fn absurd_arguments_are_errors_not_panics_or_aborts() {
    let llama = fixtures().join("tiny-llama-nf4/model");
    let dit = fixtures().join("tiny-dit-nf4/model");
    let (l, d) = (llama.to_str().expect("utf8"), dit.to_str().expect("utf8"));
    let llm = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "run",
            "--model",
            l,
            "--prompt-ids",
            "1,2,3",
            "--backend",
            "cpu",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let den = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["run", "--model", d, "--backend", "cpu", "--steps", "2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let cases: Vec<Vec<String>> = vec![
        llm(&["--slot-size", "16777216TiB"]),
        llm(&["--slot-size", "1TiB"]),
        llm(&["--slots", "18446744073709551615"]),
        llm(&["--slots", "1000000000000"]),
        llm(&["--max-tokens", "18446744073709551615"]),
        llm(&["--temperature", "NaN"]),
        llm(&["--top-p", "inf"]),
        den(&["--steps", "18446744073709551615"]),
        den(&["--text-len", "1000000000000"]),
        den(&["--text-len", "0"]),
        den(&["--height", "1000000", "--width", "1000000"]),
        den(&["--shift", "0"]),
        den(&["--shift", "NaN"]),
        den(&["--guidance", "NaN"]),
        vec![
            "bench".into(),
            "stream".into(),
            "--model".into(),
            l.into(),
            "--consume-ms-per-mib".into(),
            "1e300".into(),
        ],
        vec![
            "bench".into(),
            "stream".into(),
            "--model".into(),
            l.into(),
            "--steps".into(),
            "18446744073709551615".into(),
        ],
    ];
    for args in cases {
        let t0 = std::time::Instant::now();
        let refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let o = nibble(&refs);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("memory allocation"),
            "{args:?}: {err}"
        );
        assert!(err.contains("error"), "{args:?}: {err}");
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "{args:?} took {:?}",
            t0.elapsed()
        );
    }
}
