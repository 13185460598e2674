//! all-MiniLM-L6-v2 (BertModel) saved by transformers in NF4 (../shared/fixtures/minilm-nf4):
//! the tokenizer gives the fixture's ids, and the encoder gives its token embeddings (each
//! sentence's tokens, run padded to the batch's length and masked, within 2e-5 x max) and, through sentence-transformers' pooling
//! and normalization, its sentence embeddings (atol 2e-5, cosine >= 0.99999), on cpu_ref, the
//! optimized CPU backend, wgpu and CUDA where present, resident and with every layer streamed.

use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::bert::{self, Encoder, Pooling};
use nibble_core::models::text::TextTokenizer;
use nibble_core::plan::Budgets;
use nibble_tests::*;

fn model() -> ModelIndex {
    ModelIndex::open(&fixture("minilm-nf4/model")).expect("minilm")
}

fn expected() -> Expected {
    Expected::open(&fixture("minilm-nf4/expected.safetensors"))
}

/// An i64 tensor of the expected file, with its shape.
fn ints(e: &Expected, name: &str) -> (Vec<i64>, Vec<usize>) {
    let shape = e
        .index()
        .require(name)
        .expect(name)
        .shape
        .iter()
        .map(|&d| d as usize)
        .collect();
    let b = e.bytes(name).expect(name);
    let v = b
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
        .collect();
    (v, shape)
}

/// The fixture's sentences as id rows without padding, with their token types.
fn batch(e: &Expected) -> Vec<(Vec<u32>, Vec<u32>)> {
    let (ids, shape) = ints(e, "input_ids");
    let (types, _) = ints(e, "token_type_ids");
    let (mask, _) = ints(e, "attention_mask");
    let (rows, t) = (shape[0], shape[1]);
    (0..rows)
        .map(|r| {
            let n = mask[r * t..(r + 1) * t].iter().filter(|&&m| m != 0).count();
            let row = |v: &[i64]| v[r * t..r * t + n].iter().map(|&x| x as u32).collect();
            (row(&ids), row(&types))
        })
        .collect()
}

#[test]
fn tokenizer_gives_the_fixture_ids() {
    let m = model();
    let e = expected();
    let manifest = read_json(&fixture("minilm-nf4/manifest.json"));
    let sentences: Vec<&str> = manifest["sentences"]
        .as_array()
        .expect("sentences")
        .iter()
        .map(|s| s.as_str().expect("text"))
        .collect();
    let rows = batch(&e);
    assert_eq!(sentences.len(), rows.len());
    let tok = TextTokenizer::for_model(&m).expect("tokenizer");
    for (s, (want, _)) in sentences.iter().zip(&rows) {
        assert_eq!(&tok.encode(s, true).expect("encode"), want, "{s}");
    }
}

fn opts(m: &ModelIndex, seq_len: usize, streamed: bool, backend: &mut impl Backend) -> ExecOptions {
    let mut budgets = Budgets {
        device_bytes: 1 << 30,
        ring_slots: 2,
        slot_bytes: 64 << 10,
        host_tier_bytes: 0,
    };
    if streamed {
        let bg = bert::build(m, seq_len).expect("graph");
        budgets.device_bytes =
            nibble_core::plan::min_device_bytes(&bg.graph, m, backend).expect("min budget");
    }
    ExecOptions {
        budgets,
        readers: 2,
        stream_all: streamed,
        naive: false,
    }
}

/// Agreement with the reference: token embeddings (x max|want|), sentence embeddings (max
/// absolute error, least cosine).
#[derive(Debug, Clone, Copy)]
struct Tol {
    tokens: f64,
    atol: f32,
    cosine: f64,
}

/// The fixture's tolerances (manifest `tolerances`), for backends that accumulate f32 products
/// of f32 activations and exactly dequantized weights.
const F32: Tol = Tol {
    tokens: 2e-5,
    atol: 2e-5,
    cosine: 0.99999,
};
/// CUDA runs 4-bit linears over more than 8 rows as bf16 x bf16 cuBLAS GEMM (f32 accumulation):
/// bf16's 8-bit mantissa bounds the agreement.
const BF16_GEMM: Tol = Tol {
    tokens: 2e-2,
    atol: 5e-3,
    cosine: 0.999,
};

fn check<B: Backend>(make: impl FnMut() -> B, label: &str) {
    check_within(make, label, F32)
}

fn check_within<B: Backend>(mut make: impl FnMut() -> B, label: &str, tol: Tol) {
    let m = model();
    let e = expected();
    let rows = batch(&e);
    let (_, shape) = ints(&e, "input_ids");
    let seq_len = shape[1];
    let hidden = bert::BertConfig::of(&m).expect("config").hidden;
    let tokens_want = e
        .f32("token_embeddings_nf4_deq_fp32")
        .expect("token embeddings");
    let emb_want = e.f32("emb_nf4_deq_fp32").expect("sentence embeddings");
    let pooling = Pooling::for_model(&m).expect("pooling");
    assert!(pooling.normalize, "modules.json lists Normalize");
    for streamed in [false, true] {
        let mut b = make();
        let o = opts(&m, seq_len, streamed, &mut b);
        let mut enc = Encoder::new(&m, b, seq_len, o).expect("encoder");
        if streamed {
            assert_eq!(enc.executor().plan().counts().0, 0, "{label}: all streamed");
        }
        for (r, (ids, types)) in rows.iter().enumerate() {
            let what = format!("{label} streamed={streamed} sentence {r}");
            let (states, mask, stats) = enc.forward(ids, Some(types)).expect("forward");
            if streamed {
                assert!(stats.stream.bytes > 0, "{what}: weights streamed");
            }
            // The reference keeps the states of the sentence's own tokens (zeros where the
            // batch is padded).
            let n = ids.len() * hidden;
            let want = &tokens_want[r * seq_len * hidden..][..n];
            let err = max_err_rel_to_max(&states[..n], want);
            assert!(
                err <= tol.tokens,
                "{what}: token embeddings error {err:e} x max"
            );
            let got = pooling.pool(&states, &mask, hidden);
            let want = &emb_want[r * hidden..(r + 1) * hidden];
            let atol = max_abs_err(&got, want);
            let dot: f64 = got
                .iter()
                .zip(want)
                .map(|(&g, &w)| g as f64 * w as f64)
                .sum();
            let norm = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
            let cos = dot / (norm(&got) * norm(want));
            assert!(
                atol <= tol.atol as f64 && cos >= tol.cosine,
                "{what}: sentence embedding max error {atol:e}, cosine {cos}"
            );
        }
    }
}

#[test]
fn minilm_embeddings_on_cpu_ref() {
    check(CpuRefBackend::new, "cpu_ref");
}

#[test]
fn minilm_embeddings_on_cpu() {
    check(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn minilm_embeddings_on_wgpu() {
    if wgpu_or_absent("minilm").is_none() {
        return;
    }
    check(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

#[test]
fn minilm_embeddings_on_cuda() {
    if cuda_or_absent("minilm").is_some() {
        check_within(
            || nibble_cuda::CudaBackend::new().expect("cuda"),
            "cuda",
            BF16_GEMM,
        );
    }
}
