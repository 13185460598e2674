//! Greedy generation through a [`BatchDecoder`] the way the API server schedules it, for the
//! batching tests: the first `alone` sequences are prefilled by chunk passes of their own, the
//! rest in mixed passes beside the decoding of the others, then every sequence is decoded
//! together until each has `n` tokens.

use nibble_core::backend::Backend;
use nibble_core::models::llama::BatchDecoder;

/// The index of the largest value (the lowest index among equals).
pub fn argmax(v: &[f32]) -> u32 {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]).then(b.cmp(&a)))
        .expect("non-empty") as u32
}

/// Per sequence: its `n` greedy tokens and the logits each was picked from. Sequence i lives in
/// slot `slots[i]`.
pub fn generate<B: Backend>(
    d: &mut BatchDecoder<B>,
    prompts: &[Vec<u32>],
    slots: &[usize],
    alone: usize,
    n: usize,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let k = prompts.len();
    let mut next = vec![0u32; k];
    let mut got: Vec<(Vec<u32>, Vec<Vec<f32>>)> = vec![(Vec::new(), Vec::new()); k];
    let mut fed = vec![0usize; k];
    for i in 0..alone.min(k) {
        let mut l = Vec::new();
        for c in prompts[i].chunks(d.shape.chunk) {
            l = d.prefill(slots[i], c).expect("prefill").0;
        }
        fed[i] = prompts[i].len();
        next[i] = argmax(&l);
        got[i].0.push(next[i]);
        got[i].1.push(l);
    }
    while got.iter().any(|g| g.0.len() < n) {
        let mut feeds = Vec::new();
        let mut who = Vec::new();
        for i in 0..k {
            if fed[i] < prompts[i].len() {
                let end = (fed[i] + d.shape.mix).min(prompts[i].len());
                feeds.push((slots[i], prompts[i][fed[i]..end].to_vec()));
                fed[i] = end;
                who.push(i);
            } else if got[i].0.len() < n {
                feeds.push((slots[i], vec![next[i]]));
                who.push(i);
            }
        }
        let prompting = who.iter().any(|&i| got[i].0.is_empty());
        let ls = if prompting {
            d.step_mixed(&feeds).expect("mixed pass").0
        } else {
            let rows: Vec<(usize, u32)> = feeds.iter().map(|(s, t)| (*s, t[0])).collect();
            d.decode(&rows).expect("decode").0
        };
        for (&i, l) in who.iter().zip(ls) {
            if fed[i] < prompts[i].len() {
                continue; // mid-prompt: no token yet
            }
            next[i] = argmax(&l);
            got[i].0.push(next[i]);
            got[i].1.push(l);
        }
    }
    got
}
