//! LoRA adapters written by peft (../shared/fixtures/tiny-llama-nf4/lora) on the tiny NF4 Llama:
//! one adapter, two at once, a scale other than 1, keys with and without peft's prefix. The
//! logits of the whole sequence (prompt and generated tokens) within 1e-5 x max|logit| of peft's
//! and the greedy tokens exact (prefill, then one token at a time through the KV cache), on
//! cpu_ref, cpu and wgpu, resident and streamed; streamed, every step reads exactly the bytes of
//! the run without adapters, and the adapters stay resident.

use nibble_core::backend::cpu::CpuBackend;
use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::LlamaShape;
use nibble_core::models::lora::{self, AdapterArg, Target};
use nibble_tests::batch::argmax;
use nibble_tests::build::{build_file, f32_entry, RawEntry};
use nibble_tests::llama::{all_logits, decoder, opts};
use nibble_tests::*;

fn base() -> ModelIndex {
    ModelIndex::open(&fixture("tiny-llama-nf4/model")).expect("tiny-llama")
}

fn expected() -> Expected {
    Expected::open(&fixture("tiny-llama-nf4/lora/expected.safetensors"))
}

fn ids(e: &Expected, name: &str) -> Vec<u32> {
    let b = e.bytes(name).expect(name);
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32)
        .collect()
}

/// The base with `args` (`folder[:scale]` under the fixture's lora/) bound.
fn adapted(args: &[&str]) -> ModelIndex {
    let args: Vec<AdapterArg> = args
        .iter()
        .map(|a| {
            let p = fixture("tiny-llama-nf4/lora").join(a);
            AdapterArg::parse(&p.to_string_lossy()).expect("arg")
        })
        .collect();
    let files = lora::open_all(&args, Default::default()).expect("open adapters");
    lora::bind(&base(), &files, Target::model(), false)
        .expect("bind")
        .0
}

/// The conditions of the fixture: name in expected.safetensors, adapters given.
const CONDITIONS: [(&str, &[&str]); 5] = [
    ("attn_qv", &["attn_qv"]),
    ("attn_qv", &["attn_qv_no_prefix"]),
    ("all_linear", &["all_linear"]),
    ("both", &["attn_qv", "all_linear"]),
    ("scaled", &["all_linear:0.5"]),
];

/// Greedy tokens through the KV cache and the bytes each decode step streamed.
fn greedy<B: Backend>(
    m: &ModelIndex,
    make: &mut impl FnMut() -> B,
    prompt: &[u32],
    n: usize,
    o: ExecOptions,
) -> (Vec<u32>, Vec<u64>, (usize, usize)) {
    let mut d = decoder(m, make, LlamaShape::generate(prompt.len(), n), o);
    let counts = d.executor().plan().counts();
    let (last, _) = d.prefill(prompt).expect("prefill");
    let mut got = vec![argmax(&last)];
    let mut bytes = Vec::new();
    while got.len() < n {
        let (l, s) = d.decode(*got.last().expect("token")).expect("decode");
        bytes.push(s.stream.bytes);
        got.push(argmax(&l));
    }
    (got, bytes, counts)
}

fn check_backend<B: Backend>(mut make: impl FnMut() -> B, label: &str) {
    let e = expected();
    let prompt = ids(&e, "prompt_ids");
    let plain = base();
    let (_, plain_bytes, plain_counts) = greedy(&plain, &mut make, &prompt, 4, opts(true));
    assert_eq!(plain_counts.0, 0, "{label}: the base streams whole");
    for (cond, args) in CONDITIONS {
        let m = adapted(args);
        let seq = ids(&e, &format!("{cond}.full_sequence_ids"));
        let want = e
            .f32(&format!("{cond}.full_sequence_logits"))
            .expect("logits");
        let tokens_want = ids(&e, &format!("{cond}.greedy_tokens"));
        for streamed in [false, true] {
            let mut d = decoder(&m, &mut make, all_logits(seq.len()), opts(streamed));
            let (logits, _) = d.prefill(&seq).expect("prefill");
            let err = max_err_rel_to_max(&logits, &want);
            assert!(
                err <= 1e-5,
                "{label} {args:?} streamed={streamed}: logits error {err:e} x max"
            );
            let (tokens, bytes, counts) =
                greedy(&m, &mut make, &prompt, tokens_want.len(), opts(streamed));
            assert_eq!(
                tokens, tokens_want,
                "{label} {args:?} streamed={streamed}: greedy tokens"
            );
            if streamed {
                assert_eq!(
                    counts,
                    (args.len(), plain_counts.1),
                    "{label} {args:?}: the adapters resident, every base group streamed"
                );
                assert_eq!(
                    &bytes[..plain_bytes.len().min(bytes.len())],
                    &plain_bytes[..plain_bytes.len().min(bytes.len())],
                    "{label} {args:?}: bytes streamed per decode step as without adapters"
                );
            }
        }
    }
}

#[test]
fn peft_adapters_on_cpu_ref() {
    check_backend(CpuRefBackend::new, "cpu_ref");
}

#[test]
fn peft_adapters_on_cpu() {
    check_backend(CpuBackend::new, "cpu");
}

#[test]
fn peft_adapters_on_wgpu() {
    if wgpu_or_absent("LoRA adapters").is_none() {
        return;
    }
    check_backend(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// The adapters change what the model computes: the base's logits are far from an adapter's.
#[test]
fn an_adapter_moves_the_logits() {
    let e = expected();
    let seq = ids(&e, "attn_qv.full_sequence_ids");
    let mut d = decoder(
        &base(),
        &mut CpuRefBackend::new,
        all_logits(seq.len()),
        opts(false),
    );
    let (plain, _) = d.prefill(&seq).expect("prefill");
    let want = e.f32("attn_qv.full_sequence_logits").expect("logits");
    assert!(max_err_rel_to_max(&plain, &want) > 1e-3);
}

/// Files that do not fit the model are refused naming the key: a module the model does not have,
/// a rank that disagrees between the halves, a shape that does not fit the weight.
#[test]
fn adapters_that_do_not_fit_are_refused_naming_the_key() {
    let src = fixture("tiny-llama-nf4/lora/attn_qv/adapter_model.safetensors");
    let m = ModelIndex::open(&src).expect("adapter");
    let read = |name: &str| {
        let t = m.get(name).expect(name);
        (t.shape.clone(), m.read_f32(t).expect("read"))
    };
    let dir = tempfile::tempdir().expect("tmp");
    let q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
    let cases: Vec<(&str, Vec<RawEntry>, &str)> = {
        let (sa, va) = read(q_a);
        let (sb, vb) = read(q_b);
        vec![
            (
                "unknown module",
                vec![
                    f32_entry(&q_a.replace("q_proj", "x_proj"), &sa, &va),
                    f32_entry(&q_b.replace("q_proj", "x_proj"), &sb, &vb),
                ],
                "x_proj",
            ),
            (
                "rank mismatch",
                vec![
                    f32_entry(q_a, &sa, &va),
                    f32_entry(q_b, &[sb[0] / 2, sb[1] * 2], &vb),
                ],
                "lora_B",
            ),
            (
                "wrong input width",
                vec![
                    f32_entry(q_a, &[sa[0] * 2, sa[1] / 2], &va),
                    f32_entry(q_b, &[sb[0], sb[1] * 2], &[vb.clone(), vb.clone()].concat()),
                ],
                "does not fit",
            ),
            ("a half alone", vec![f32_entry(q_a, &sa, &va)], "no partner"),
        ]
    };
    for (what, tensors, says) in cases {
        let path = dir
            .path()
            .join(format!("{}.safetensors", what.replace(' ', "_")));
        build_file(&path, &tensors);
        let arg = AdapterArg::parse(&path.to_string_lossy()).expect("arg");
        let files = lora::open_all(&[arg], Default::default()).expect("open");
        let err = lora::bind(&base(), &files, Target::model(), false)
            .expect_err(what)
            .to_string();
        assert!(err.contains(says), "{what}: {err}");
        assert!(
            err.contains(".safetensors"),
            "{what}: names the file: {err}"
        );
    }
}
