//! SmolLM2-135M-Instruct in NF4, converted by `nibble convert` from llama.cpp's Q4_1 GGUF
//! (`scripts/get-smollm2.sh` makes `models/smollm2-135m-nf4`), against what transformers computes
//! on the same NF4 weights (`../shared/fixtures/smollm2/reference.json`):
//! - every converted tensor has the reference sha256 (the conversion equals bitsandbytes');
//! - the chat template and tokenizer give the reference prompt ids;
//! - greedy decoding through the KV cache gives the reference tokens up to the robust prefix
//!   (steps whose top-1/top-2 margin is at least 0.05 logits);
//! - teacher forcing (prompt + reference continuation in one pass): wherever the reference
//!   margin is at least 0.05 the argmax is the reference token, and the top-5 logits agree within
//!   1e-3 x max.
//!
//! Runs on the optimized CPU backend, which the conformance suite checks against cpu_ref.

use std::path::PathBuf;

use nibble_core::backend::cpu::CpuBackend;
use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::{Decoder, LlamaShape};
use nibble_core::models::text::{Message, TextTokenizer};
use nibble_core::plan::Budgets;
use nibble_tests::*;
use sha2::{Digest, Sha256};

const MARGIN: f64 = 0.05;

fn model_dir() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-nf4");
    assert!(
        p.join("model.safetensors").is_file(),
        "{} is missing: run scripts/get-smollm2.sh (the README's test command does)",
        p.display()
    );
    p
}

fn reference() -> serde_json::Value {
    read_json(&fixture("smollm2/reference.json"))
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn opts() -> ExecOptions {
    ExecOptions {
        budgets: Budgets {
            device_bytes: 2 << 30,
            ring_slots: 4,
            slot_bytes: 16 << 20,
            host_tier_bytes: 0,
        },
        readers: 2,
        stream_all: false,
        naive: false,
    }
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]))
        .expect("non-empty") as u32
}

#[test]
fn converted_tensors_equal_the_reference() {
    let dir = model_dir();
    let m = ModelIndex::open(&dir).expect("open");
    let r = reference();
    let want = r["tensor_sha256"].as_object().expect("hashes");
    assert_eq!(m.len(), want.len(), "tensor count");
    let mut bad = Vec::new();
    for t in m.tensors() {
        let bytes = m.read_bytes(t).expect("read");
        let got: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        match want.get(&t.name).and_then(|v| v.as_str()) {
            Some(w) if w == got => {}
            _ => bad.push(t.name.clone()),
        }
    }
    assert!(
        bad.is_empty(),
        "{} tensors differ, e.g. {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

#[test]
fn chat_template_gives_the_reference_prompt_ids() {
    let m = ModelIndex::open(&model_dir()).expect("open");
    let tok = TextTokenizer::for_model(&m).expect("tokenizer");
    for p in reference()["prompts"].as_array().expect("prompts") {
        let msg = p["user_message"].as_str().expect("message");
        let text = tok
            .apply_chat_template(&[Message::new("user", msg)], true)
            .expect("template");
        assert_eq!(
            text,
            p["prompt_text"].as_str().expect("text"),
            "rendered chat"
        );
        let ids = tok.encode(&text, false).expect("encode");
        assert_eq!(ids, u32s(&p["prompt_ids"]), "prompt ids for {msg:?}");
    }
}

#[test]
fn greedy_and_teacher_forced_match_transformers() {
    let m = ModelIndex::open(&model_dir()).expect("open");
    for p in reference()["prompts"].as_array().expect("prompts") {
        let prompt = u32s(&p["prompt_ids"]);
        let nf4 = &p["nf4"];
        let greedy = u32s(&nf4["greedy_ids"]);
        let margins: Vec<f64> = nf4["top2_margin"]
            .as_array()
            .expect("margins")
            .iter()
            .map(|v| v.as_f64().expect("margin"))
            .collect();
        assert_eq!(
            margins.len(),
            greedy.len(),
            "one top-2 margin per greedy step"
        );
        // `robust_prefix_len` is keyed by the threshold as Python prints it ("0.05").
        let robust = nf4["robust_prefix_len"][format!("{MARGIN}").as_str()]
            .as_u64()
            .expect("prefix") as usize;

        // Greedy through the KV cache.
        let shape = LlamaShape::generate(prompt.len(), greedy.len());
        let mut d = Decoder::new(&m, CpuBackend::new(), shape, opts()).expect("decoder");
        let (mut last, _) = d.prefill(&prompt).expect("prefill");
        let mut got = Vec::new();
        while got.len() < greedy.len() {
            let t = argmax(&last);
            got.push(t);
            if got.len() < greedy.len() {
                last = d.decode(t).expect("decode").0;
            }
        }
        assert_eq!(
            &got[..robust],
            &greedy[..robust],
            "greedy tokens within the robust prefix of {robust}"
        );

        // Teacher forcing: the prompt and the reference continuation in one pass.
        let mut seq = prompt.clone();
        seq.extend_from_slice(&greedy[..greedy.len() - 1]);
        let shape = LlamaShape {
            prompt: seq.len(),
            capacity: seq.len(),
            all_logits: true,
            hidden_states: false,
        };
        let mut d = Decoder::new(&m, CpuBackend::new(), shape, opts()).expect("decoder");
        let (logits, _) = d.prefill(&seq).expect("prefill");
        let vocab = d.config.vocab;
        let tf = &nf4["teacher_forced_top5"];
        let (ids, vals) = (
            tf["ids"].as_array().expect("ids"),
            tf["values"].as_array().expect("values"),
        );
        let mut checked = 0;
        let mut worst = 0f64;
        for (i, margin) in margins.iter().enumerate() {
            if *margin < MARGIN {
                continue;
            }
            let pos = prompt.len() - 1 + i;
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            assert_eq!(
                argmax(row),
                greedy[i],
                "argmax at step {i} (margin {margin})"
            );
            let want: Vec<f64> = vals[i]
                .as_array()
                .expect("top5")
                .iter()
                .map(|v| v.as_f64().expect("v"))
                .collect();
            let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
            for (id, w) in u32s(&ids[i]).iter().zip(&want) {
                let g = row[*id as usize] as f64;
                worst = worst.max((g - w).abs() / scale);
                assert!(
                    (g - w).abs() <= 1e-3 * scale,
                    "step {i}: logit of {id} is {g}, transformers {w}"
                );
            }
            checked += 1;
        }
        // At least 5/6 of the reference steps (40 of 48) are clear enough to check.
        assert!(
            checked > 0 && checked * 6 >= margins.len() * 5,
            "only {checked} of {} steps checked",
            margins.len()
        );
        let same = got.iter().zip(&greedy).take_while(|(a, b)| a == b).count();
        println!(
            "{:?}: greedy equal for {same}/{} tokens (robust prefix {robust}); teacher-forced \
             {checked} steps checked, worst top-5 error {worst:.2e} x max",
            p["user_message"].as_str().unwrap_or(""),
            greedy.len()
        );
    }
}

/// The optimized CPU backend keeps SmolLM2's bf16 embedding table (tied to lm_head) as the bf16
/// the model stores instead of an f32 copy: the plan's resident dense bytes drop by exactly half
/// the table, and the logits of every prompt position agree with cpu_ref's (which widens the
/// table to f32) within 1e-5 x max. Streamed every pass through small slots that split the
/// table at many places, the greedy tokens and decode logits are those of the resident run.
#[test]
fn cpu_keeps_bf16_tables_at_half_the_bytes_with_cpu_ref_results() {
    let m = ModelIndex::open(&model_dir()).expect("open");
    let table = m.require("model.embed_tokens.weight").expect("table");
    assert_eq!(
        table.dtype,
        nibble_core::format::dtype::Dtype::BF16,
        "the converted table"
    );
    let table_elems = table.numel();
    let prompt = u32s(&reference()["prompts"][0]["prompt_ids"]);
    let prompt = &prompt[..prompt.len().min(8)];
    let shape = LlamaShape {
        prompt: prompt.len(),
        capacity: prompt.len(),
        all_logits: true,
        hidden_states: false,
    };
    let mut cpu = Decoder::new(&m, CpuBackend::new(), shape, opts()).expect("cpu");
    let mut rf = Decoder::new(&m, CpuRefBackend::new(), shape, opts()).expect("cpu_ref");
    let dense = |p: &nibble_core::plan::MemoryPlan| p.resident_dense_bytes;
    let (d_cpu, d_ref) = (dense(cpu.executor().plan()), dense(rf.executor().plan()));
    assert_eq!(
        d_ref - d_cpu,
        table_elems * 2,
        "cpu {d_cpu} B of resident dense weights, cpu_ref {d_ref} B"
    );
    let (got, _) = cpu.prefill(prompt).expect("cpu prefill");
    let (want, _) = rf.prefill(prompt).expect("cpu_ref prefill");
    let err = max_err_rel_to_max(&got, &want);
    assert!(err <= 1e-5, "cpu vs cpu_ref logits: {err:.2e} x max");

    // Resident against every group streamed through 2 x 1 MiB slots.
    let n = 6;
    let run = |o: ExecOptions| {
        let mut d = Decoder::new(
            &m,
            CpuBackend::new(),
            LlamaShape::generate(prompt.len(), n),
            o,
        )
        .expect("decoder");
        let streamed = d.executor().plan().streamed_bytes_per_step;
        let (mut last, _) = d.prefill(prompt).expect("prefill");
        let (mut tokens, mut logits) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let t = argmax(&last);
            tokens.push(t);
            last = d.decode(t).expect("decode").0;
            logits.extend_from_slice(&last);
        }
        (tokens, logits, streamed)
    };
    let (t_res, l_res, s_res) = run(opts());
    let mut small = opts();
    small.stream_all = true;
    small.budgets.ring_slots = 2;
    small.budgets.slot_bytes = 1 << 20;
    let (t_str, l_str, s_str) = run(small);
    assert_eq!(s_res, 0, "the resident run streams nothing");
    assert!(
        s_str >= table.len,
        "the streamed run reads the table each pass ({s_str} B per step)"
    );
    assert_eq!(t_str, t_res, "greedy tokens, streamed vs resident");
    assert_bits_eq(&l_str, &l_res, "decode logits, streamed vs resident");
}

/// Opening SmolLM2 over HTTP and planning a run reads config.json, probes the two shard-index
/// names, opens model.safetensors (bytes 0-7, then the header) and reads the quant-state JSONs,
/// one request per run of adjacent ones: nothing else, and nothing twice.
#[test]
fn opening_and_planning_over_http_reads_each_quant_state_once() {
    use nibble_core::models::llama;
    use nibble_tests::http_server::{Fault, TestServer};
    let dir = model_dir();
    let mut files = std::collections::HashMap::new();
    for e in std::fs::read_dir(&dir).expect("dir") {
        let p = e.expect("entry").path();
        let name = p.file_name().and_then(|n| n.to_str()).expect("name");
        files.insert(format!("m/{name}"), std::fs::read(&p).expect("read"));
    }
    let srv = TestServer::start(files, Fault::None);
    let m = ModelIndex::open_url(&format!("{}/m", srv.base), Default::default()).expect("open");
    let lg = llama::build(&m, LlamaShape::generate(8, 8)).expect("graph");
    let o = opts();
    nibble_core::plan::plan_graph(
        &lg.graph,
        &m,
        &mut CpuBackend::new(),
        o.budgets,
        o.stream_all,
    )
    .expect("plan");
    let requests = srv.stats().requests;
    // Runs of adjacent quant-state tensors, from the local copy's header.
    let local = ModelIndex::open(&dir).expect("local");
    let mut qs: Vec<_> = local
        .q4_weights()
        .expect("4-bit weights")
        .iter()
        .map(|k| local.require(&k.quant_state).expect("quant state").clone())
        .collect();
    qs.sort_by_key(|e| e.offset);
    let runs = 1 + qs.windows(2).filter(|w| w[0].end() != w[1].offset).count();
    assert!(qs.len() > 100, "SmolLM2 has {} 4-bit weights", qs.len());
    eprintln!(
        "opening + planning SmolLM2 over HTTP: {requests} requests ({} quant states in {runs} runs)",
        qs.len()
    );
    assert_eq!(
        requests,
        1 + 2 + 2 + runs,
        "config.json, 2 index probes, bytes 0-7 and the header of model.safetensors, one request \
         per run of quant states"
    );
}

/// The API server's batched decoding on SmolLM2: the two reference prompts and six more chat
/// prompts decoded together (two prefilled alone, six in mixed passes beside the decoding of the
/// others) give each the greedy tokens it gets alone through the plain decoder, except where the
/// solo run's top-2 margin is below the tolerance the conformance suite allows (then the rest
/// of that sequence is not compared); the logits agree within 1e-3 x max up to there.
#[test]
fn batched_decoding_equals_solo_decoding() {
    use nibble_core::models::llama::{build_batched, BatchDecoder, BatchShape};
    let m = ModelIndex::open(&model_dir()).expect("open");
    let tok = TextTokenizer::for_model(&m).expect("tokenizer");
    let mut prompts: Vec<Vec<u32>> = reference()["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| u32s(&p["prompt_ids"]))
        .collect();
    for text in [
        "Name three colors.",
        "Write a haiku about the sea.",
        "What is 2 + 2?",
        "Who wrote Hamlet?",
        "Explain gravity in one sentence.",
        "Say hello in Spanish.",
    ] {
        prompts.push(tok.prompt_ids(text, true).expect("prompt"));
    }
    let n = 24;
    let solo: Vec<(Vec<u32>, Vec<Vec<f32>>)> = prompts
        .iter()
        .map(|p| {
            let shape = LlamaShape::generate(p.len(), n);
            let mut d = Decoder::new(&m, CpuBackend::new(), shape, opts()).expect("decoder");
            let (mut l, _) = d.prefill(p).expect("prefill");
            let (mut toks, mut logits) = (Vec::new(), Vec::new());
            for _ in 0..n {
                toks.push(argmax(&l));
                logits.push(l.clone());
                l = d.decode(*toks.last().expect("token")).expect("decode").0;
            }
            (toks, logits)
        })
        .collect();
    let shape = BatchShape {
        slots: 8,
        context: 128,
        chunk: 16,
        mix: 4,
    };
    let bg = build_batched(&m, shape).expect("batched graph");
    let mut d = BatchDecoder::new(bg, &m, CpuBackend::new(), opts()).expect("batch decoder");
    let slots: Vec<usize> = (0..prompts.len()).collect();
    let got = nibble_tests::batch::generate(&mut d, &prompts, &slots, 2, n);
    for (i, ((gt, gl), (wt, wl))) in got.iter().zip(&solo).enumerate() {
        for s in 0..n {
            let e = max_err_rel_to_max(&gl[s], &wl[s]);
            assert!(e <= 1e-3, "sequence {i} step {s}: logits {e} x max apart");
            if gt[s] != wt[s] {
                let mut sorted = wl[s].clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let max = sorted[0].abs().max(sorted[sorted.len() - 1].abs()) as f64;
                let margin = (sorted[0] - sorted[1]) as f64;
                assert!(
                    margin <= 1e-3 * max,
                    "sequence {i} step {s}: token {} alone, {} batched, with a top-2 margin of {margin}",
                    wt[s],
                    gt[s]
                );
                break;
            }
        }
    }
}
