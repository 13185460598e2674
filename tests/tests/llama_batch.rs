//! Batched decoding (the API server's): sequences in their own KV cache slots, prefilled a chunk
//! per pass and decoded together one token per pass, give each sequence the logits and greedy
//! tokens it gets alone through the plain decoder (`nibble run`'s), on every backend, resident
//! and with every layer streamed. Prompts of different lengths (longer than a chunk, shorter,
//! exactly one), slots used out of order, a slot freed and reused; two prompts prefilled by
//! chunk passes of their own, two in mixed passes beside the decoding of the others.

use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::{self, BatchDecoder, BatchShape, Decoder, LlamaShape};
use nibble_core::plan::Budgets;
use nibble_tests::batch::argmax;
use nibble_tests::*;

fn model() -> ModelIndex {
    ModelIndex::open(&fixture("tiny-llama-nf4/model")).expect("tiny-llama")
}

fn opts(device_bytes: u64, streamed: bool) -> ExecOptions {
    ExecOptions {
        budgets: Budgets {
            device_bytes,
            ring_slots: 2,
            slot_bytes: 64 << 10,
            host_tier_bytes: 0,
        },
        readers: 2,
        stream_all: streamed,
        naive: false,
    }
}

/// Greedy tokens and each step's logits of `prompt` alone through the plain decoder.
fn solo<B: Backend>(
    m: &ModelIndex,
    backend: B,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let lg = llama::build(m, LlamaShape::generate(prompt.len(), n)).expect("graph");
    let mut d = Decoder::from_graph(lg, m, backend, opts(1 << 30, false)).expect("decoder");
    let (mut l, _) = d.prefill(prompt).expect("prefill");
    let (mut toks, mut logits) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = argmax(&l);
        toks.push(t);
        logits.push(l.clone());
        l = d.decode(t).expect("decode").0;
    }
    (toks, logits)
}

fn check<B: Backend>(mut make: impl FnMut() -> B, label: &str, tol: f64) {
    let m = model();
    let vocab = 256u32;
    let prompts: Vec<Vec<u32>> = [11usize, 3, 4, 1]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len as u32)
                .map(|j| (j * 37 + i as u32 * 11 + 5) % vocab)
                .collect()
        })
        .collect();
    let n = 6;
    let want: Vec<_> = prompts.iter().map(|p| solo(&m, make(), p, n)).collect();
    let shape = BatchShape {
        slots: 4,
        context: 24,
        chunk: 4,
        mix: 3,
    };
    let bg = llama::build_batched(&m, shape).expect("batched graph");
    let least = nibble_core::plan::min_device_bytes(&bg.graph, &m, &mut make()).expect("min");
    for streamed in [false, true] {
        let bg = llama::build_batched(&m, shape).expect("batched graph");
        let o = if streamed {
            opts(least, true)
        } else {
            opts(1 << 30, false)
        };
        let mut d = BatchDecoder::new(bg, &m, make(), o).expect("batch decoder");
        // Sequence i in slot order[i]: slot 3 makes every pass use the 4-row program.
        let order = [2usize, 0, 3, 1];
        // Slot 1 first holds a sequence that is dropped after two tokens, then is reused.
        let junk: Vec<u32> = vec![7, 8, 9, 10, 11];
        let (jl, _) = d.prefill(1, &junk[..4]).expect("prefill junk");
        let (_, _) = d.prefill(1, &junk[4..]).expect("prefill junk");
        d.decode(&[(1, argmax(&jl))]).expect("junk decode");
        d.reset(1);
        // Sequences 0 and 1 prefilled alone, 2 and 3 in mixed passes beside the others.
        let got = nibble_tests::batch::generate(&mut d, &prompts, &order, 2, n);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                g.0, w.0,
                "{label} streamed={streamed}: tokens of sequence {i}"
            );
            for (s, (gl, wl)) in g.1.iter().zip(&w.1).enumerate() {
                let e = max_err_rel_to_max(gl, wl);
                assert!(
                    e <= tol,
                    "{label} streamed={streamed}: sequence {i} step {s}: {e}"
                );
            }
        }
        assert_eq!(d.position(order[0]), prompts[0].len() + n - 1);
        // A sequence that would overflow its slot is refused.
        while d.position(order[0]) + 4 <= 24 {
            d.prefill(order[0], &[1; 4]).expect("fits the slot");
        }
        assert!(d.prefill(order[0], &[1; 4]).is_err(), "past the context");
    }
}

#[test]
fn batched_decoding_equals_solo_on_cpu_ref() {
    check(
        nibble_core::backend::cpu_ref::CpuRefBackend::new,
        "cpu_ref",
        1e-5,
    );
}

#[test]
fn batched_decoding_equals_solo_on_cpu() {
    check(nibble_core::backend::cpu::CpuBackend::new, "cpu", 1e-5);
}

#[test]
fn batched_decoding_equals_solo_on_wgpu() {
    if wgpu_or_absent("batched decoding").is_none() {
        return;
    }
    check(
        || nibble_wgpu::WgpuBackend::new().expect("wgpu"),
        "wgpu",
        1e-4,
    );
}
