//! The tiny Llama that transformers saved in NF4 (../shared/fixtures/tiny-llama-nf4), run through
//! the decoder graph and the executor: logits of every prompt position within 1e-5 x max|logit|
//! (prefill) and the fixture's greedy tokens (`greedy_tokens_deq`, however many) exact (prefill,
//! then one token at a time through the KV cache), on cpu_ref, the optimized CPU backend and wgpu,
//! resident and streamed through 2 slots of 64 KiB.

use nibble_core::backend::cpu::CpuBackend;
use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::{self, LlamaShape};
use nibble_tests::llama::{all_logits, decoder, opts};
use nibble_tests::*;

fn model() -> ModelIndex {
    ModelIndex::open(&fixture("tiny-llama-nf4/model")).expect("tiny-llama")
}

fn ids(e: &Expected, name: &str) -> Vec<u32> {
    let b = e.bytes(name).expect(name);
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32)
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]))
        .expect("non-empty") as u32
}

/// Logits `[T, vocab]` of every position of a token sequence, and the plan's
/// (resident, streamed) group counts.
fn forward<B: Backend>(
    m: &ModelIndex,
    make: &mut impl FnMut() -> B,
    tokens: &[u32],
    o: ExecOptions,
) -> (Vec<f32>, (usize, usize)) {
    let mut d = decoder(m, make, all_logits(tokens.len()), o);
    let counts = d.executor().plan().counts();
    (d.prefill(tokens).expect("prefill").0, counts)
}

/// Logits tolerance (x max|logit|) of the backends whose linears accumulate f32 products of f32
/// activations and exactly dequantized weights.
const LOGITS_F32: f64 = 1e-5;
/// CUDA runs the prompt's 4-bit linears (more than 8 rows) as bf16 x bf16 cuBLAS GEMM with f32
/// accumulation: bf16's 8-bit mantissa bounds the agreement.
const LOGITS_BF16_GEMM: f64 = 2e-2;

fn check_backend<B: Backend>(make: impl FnMut() -> B, label: &str) {
    check_backend_within(make, label, LOGITS_F32)
}

fn check_backend_within<B: Backend>(mut make: impl FnMut() -> B, label: &str, tol: f64) {
    let m = model();
    let e = Expected::open(&fixture("tiny-llama-nf4/expected.safetensors"));
    let prompt = ids(&e, "prompt_ids");
    let want = e.f32("logits_deq_all").expect("logits");
    let greedy_want = ids(&e, "greedy_tokens_deq");
    for (streamed, o) in [(false, opts(false)), (true, opts(true))] {
        let (logits, counts) = forward(&m, &mut make, &prompt, o);
        let err = max_err_rel_to_max(&logits, &want);
        assert!(
            err <= tol,
            "{label} streamed={streamed}: logits error {err:e} x max"
        );
        if streamed {
            assert_eq!(
                counts.0, 0,
                "{label}: nothing resident at the smallest budget {counts:?}"
            );
        }
        // Greedy decoding through the KV cache: the prompt once, then one token per step.
        let shape = LlamaShape::generate(prompt.len(), greedy_want.len());
        let mut d = decoder(&m, &mut make, shape, o);
        if streamed {
            assert_eq!(d.executor().plan().counts().0, 0, "{label}: all streamed");
        }
        let (last, _) = d.prefill(&prompt).expect("prefill");
        let mut got = vec![argmax(&last)];
        while got.len() < greedy_want.len() {
            let (l, _) = d.decode(*got.last().expect("token")).expect("decode");
            got.push(argmax(&l));
        }
        // Exact where the backend computes in f32; through bf16 (CUDA's GEMM path) up to the
        // first step whose reference top-1/top-2 gap is within twice the logits' error bound,
        // where either token is a right answer and what follows is not comparable.
        let upto = if tol > LOGITS_F32 {
            let margins = e.f32("greedy_top2_margin_deq").expect("margins");
            let bound = 2.0 * tol * want.iter().fold(0f32, |a, b| a.max(b.abs())) as f64;
            margins
                .iter()
                .position(|&m| (m as f64) < bound)
                .unwrap_or(greedy_want.len())
        } else {
            greedy_want.len()
        };
        assert_eq!(
            got[..upto],
            greedy_want[..upto],
            "{label} streamed={streamed}: greedy tokens (the first {upto} are robust)"
        );
    }
}

#[test]
fn tiny_llama_on_cpu_ref() {
    check_backend(CpuRefBackend::new, "cpu_ref");
}

#[test]
fn tiny_llama_on_cpu() {
    check_backend(CpuBackend::new, "cpu");
}

#[test]
fn tiny_llama_on_cuda() {
    if cuda_or_absent("tiny-llama").is_some() {
        check_backend_within(
            || nibble_cuda::CudaBackend::new().expect("cuda"),
            "cuda",
            LOGITS_BF16_GEMM,
        );
    }
}

#[test]
fn tiny_llama_on_wgpu() {
    if wgpu_or_absent("tiny-llama").is_none() {
        return;
    }
    check_backend(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// Tied embeddings: the table feeds the first op and the last; streamed, it is read for both
/// groups, and the logits equal the resident run's bit for bit.
#[test]
fn tied_embeddings_stream_like_resident() {
    let src = model();
    let dir = tempfile::tempdir().expect("tmp");
    let mut tensors = Vec::new();
    for t in src.tensors().filter(|t| t.name != "lm_head.weight") {
        tensors.push((
            t.name.clone(),
            t.dtype,
            t.shape.clone(),
            src.read_bytes(t).expect("read"),
        ));
    }
    nibble_core::format::writer::write_safetensors(
        &dir.path().join("model.safetensors"),
        &tensors,
        &Default::default(),
    )
    .expect("write");
    let mut cfg = src.config.clone().expect("config");
    cfg["tie_word_embeddings"] = serde_json::json!(true);
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_vec(&cfg).expect("json"),
    )
    .expect("write");
    let m = ModelIndex::open(dir.path()).expect("tied model");
    let e = Expected::open(&fixture("tiny-llama-nf4/expected.safetensors"));
    let prompt = ids(&e, "prompt_ids");
    let mut make = CpuRefBackend::new;
    let (resident, c1) = forward(&m, &mut make, &prompt, opts(false));
    let (streamed, c2) = forward(&m, &mut make, &prompt, opts(true));
    assert_eq!(c1.1, 0, "everything resident: {c1:?}");
    assert_eq!(c2.0, 0, "everything streamed: {c2:?}");
    assert_bits_eq(&streamed, &resident, "tied logits");
    let untied = e.f32("logits_deq_all").expect("logits");
    assert!(
        max_err_rel_to_max(&resident, &untied) > 1e-3,
        "the tied head really is the embedding table"
    );
}

/// A stream limited to N passes (the browser limits it to the tokens asked for, so that no read
/// runs ahead) serves exactly N; a pass beyond is an error, never a step computed with whatever
/// the pool region still holds.
#[test]
fn a_limited_stream_refuses_a_pass_beyond_its_limit() {
    let m = model();
    let e = Expected::open(&fixture("tiny-llama-nf4/expected.safetensors"));
    let prompt = ids(&e, "prompt_ids");
    let want = ids(&e, "greedy_tokens_deq");
    let mut d = decoder(
        &m,
        &mut CpuRefBackend::new,
        LlamaShape::generate(prompt.len(), 4),
        opts(true),
    );
    d.executor_mut().limit_stream_passes(2);
    let (last, _) = d.prefill(&prompt).expect("pass 1");
    assert_eq!(argmax(&last), want[0]);
    let (l, _) = d.decode(want[0]).expect("pass 2");
    assert_eq!(argmax(&l), want[1]);
    let err = d.decode(want[1]).expect_err("pass 3 is past the limit");
    assert!(err.to_string().contains("weight stream ended"), "{err}");
}

/// The optimized CPU backend reads streamed 4-bit weights in place from the ring slots (no copy
/// into its pool): with slots to spare every packed weight of every pass is read in place, with
/// two slots those that arrive while no other slot is held (one is always left to the readers),
/// with one none; the greedy
/// tokens are exact and every decode step's logits are the same bits in all three, and the held
/// slots go back to the ring after each group's last op (the stream goes on for every token).
/// The memory plan says beforehand how much may be read in place: all of it with 4 slots, an
/// upper bound with 2, nothing with 1.
#[test]
fn cpu_reads_streamed_weights_in_place() {
    let m = model();
    let e = Expected::open(&fixture("tiny-llama-nf4/expected.safetensors"));
    let prompt = ids(&e, "prompt_ids");
    let want = ids(&e, "greedy_tokens_deq");
    let packed_lens: Vec<u64> = m
        .tensors()
        .filter(|t| {
            ["nf4", "fp4"].iter().any(|q| {
                m.get(&format!("{}.quant_state.bitsandbytes__{q}", t.name))
                    .is_some()
            })
        })
        .map(|t| t.len)
        .collect();
    let largest = packed_lens.iter().copied().max().unwrap_or(0);
    let packed: u64 = packed_lens.iter().sum();
    assert!(packed > 0, "tiny-llama has 4-bit weights");
    // Slots that hold the largest packed weight whole (at least 256 KiB, in whole 4 KiB pages),
    // so that with slots to spare every packed weight can be read in place.
    let slot_bytes = (256u64 << 10).max(largest.div_ceil(4096) * 4096);
    let run = |slots: u64| {
        let mut o = opts(true);
        o.budgets.ring_slots = slots;
        o.budgets.slot_bytes = slot_bytes;
        let mut d = decoder(
            &m,
            &mut CpuBackend::new,
            LlamaShape::generate(prompt.len(), want.len()),
            o,
        );
        let planned = d.executor().plan().in_place_bytes_per_step;
        let (last, st) = d.prefill(&prompt).expect("prefill");
        let mut tokens = vec![argmax(&last)];
        let mut logits = Vec::new();
        let mut in_place = vec![st.in_place_bytes];
        while tokens.len() < want.len() {
            let (l, st) = d.decode(*tokens.last().expect("token")).expect("decode");
            tokens.push(argmax(&l));
            logits.extend_from_slice(&l);
            in_place.push(st.in_place_bytes);
        }
        assert_eq!(tokens, want, "{slots} slots: greedy tokens");
        (logits, in_place, planned)
    };
    let (logits4, in_place4, planned4) = run(4);
    assert!(
        in_place4.iter().all(|&p| p == packed),
        "4 slots: every pass reads all {packed} packed bytes in place: {in_place4:?}"
    );
    assert_eq!(planned4, packed, "4 slots: the plan's in-place bytes");
    let (logits2, in_place2, planned2) = run(2);
    assert!(
        in_place2.iter().all(|&p| p > 0 && p <= planned2),
        "2 slots: in place while one slot is left to the readers, at most the plan's \
         {planned2}: {in_place2:?}"
    );
    assert_eq!(planned2, packed, "2 slots: the plan's upper bound");
    let (logits1, in_place1, planned1) = run(1);
    assert!(in_place1.iter().all(|&p| p == 0), "1 slot: all copied");
    assert_eq!(planned1, 0, "1 slot: the plan promises nothing in place");
    assert_bits_eq(&logits4, &logits1, "decode logits, in place vs copied");
    assert_bits_eq(&logits2, &logits1, "decode logits, part in place vs copied");
}

/// What the decoder graph does not compute is refused before any weight is read, not run into
/// a different result: a tensor the graph would ignore (Qwen3-style q/k norms), a model_type of
/// another architecture, a sliding window or a dynamic-RoPE trained length shorter than the
/// sequence.
#[test]
fn models_the_decoder_does_not_compute_are_refused() {
    let src = fixture("tiny-llama-nf4/model");
    let m = model();
    let shape = LlamaShape::generate(4, 4);
    llama::build(&m, shape).expect("the fixture itself builds");
    let copy = |config: &serde_json::Value, extra: Option<&str>| {
        let dir = tempfile::tempdir().expect("tmp");
        let mut tensors: Vec<_> = m
            .tensors()
            .map(|t| {
                let bytes = m.read_bytes(t).expect("read");
                (t.name.clone(), t.dtype, t.shape.clone(), bytes)
            })
            .collect();
        if let Some(name) = extra {
            let hd = config["hidden_size"].as_u64().expect("hidden")
                / config["num_attention_heads"].as_u64().expect("heads");
            tensors.push((
                name.to_string(),
                nibble_core::format::dtype::Dtype::F32,
                vec![hd],
                vec![0u8; hd as usize * 4],
            ));
        }
        nibble_core::format::writer::write_safetensors(
            &dir.path().join("model.safetensors"),
            &tensors,
            &Default::default(),
        )
        .expect("write");
        std::fs::write(
            dir.path().join("config.json"),
            serde_json::to_vec(config).expect("json"),
        )
        .expect("config");
        dir
    };
    let config = read_json(&src.join("config.json"));
    let err = |dir: &tempfile::TempDir, shape| {
        let m = ModelIndex::open(dir.path()).expect("open");
        llama::build(&m, shape).expect_err("refused").to_string()
    };

    let d = copy(&config, Some("model.layers.0.self_attn.q_norm.weight"));
    let e = err(&d, shape);
    assert!(
        e.contains(
            "not part of a Llama-family decoder (first: model.layers.0.self_attn.q_norm.weight)"
        ),
        "{e}"
    );

    let mut qwen3 = config.clone();
    qwen3["model_type"] = "qwen3".into();
    let e = err(&copy(&qwen3, None), shape);
    assert!(e.contains("model_type: 'qwen3'"), "{e}");

    let mut mistral = config.clone();
    mistral["model_type"] = "mistral".into();
    mistral["sliding_window"] = 6.into();
    let d = copy(&mistral, None);
    let e = err(&d, LlamaShape::generate(4, 4));
    assert!(e.contains("sliding window of 6 positions"), "{e}");
    // Within the window the window changes nothing: it runs.
    let m2 = ModelIndex::open(d.path()).expect("open");
    llama::build(&m2, LlamaShape::generate(3, 3)).expect("prompt + new tokens fit the window");

    // Dynamic NTK RoPE: the default frequencies up to the trained length, refused past it.
    let mut dynamic = config.clone();
    dynamic["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0});
    dynamic["max_position_embeddings"] = 6.into();
    let d = copy(&dynamic, None);
    let e = err(&d, LlamaShape::generate(4, 4));
    assert!(e.contains("past 6 positions"), "{e}");
    let m3 = ModelIndex::open(d.path()).expect("open");
    let a = llama::build(&m3, LlamaShape::generate(3, 3)).expect("fits the trained length");
    let b = llama::build(&m, LlamaShape::generate(3, 3)).expect("default rope");
    assert_eq!(a.config.inv_freq(), b.config.inv_freq());
}
