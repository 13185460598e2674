//! Token generation, once for every front end (`nibble run`, the browser, the API server): the
//! end-of-sequence ids a model declares, the sampler (greedy, or temperature with top-k and
//! top-p, drawn from a seeded generator), and [`Generation`], the loop that runs the prompt, then
//! one decode pass per further token, and stops at the token limit or an end-of-sequence id.

use serde::Deserialize;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::ExecStats;
use crate::format::json::{typed_bytes, TokenIds};
use crate::io::model::ModelIndex;
use crate::models::llama::{Decoder, LlamaConfig};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token); above: softmax of `logits / temperature`.
    pub temperature: f32,
    /// Sample among the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Sample among the most likely tokens that hold this much probability (1: all).
    pub top_p: f32,
    /// Seed of the draws: the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for Sampling {
    /// Greedy.
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Refuses what cannot be sampled: a temperature that is negative or not finite, a `top_p`
    /// outside (0, 1].
    pub fn check(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::Invalid(format!(
                "temperature {} is not a finite number >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Invalid(format!(
                "top_p {} is not in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Picks tokens from logits as [`Sampling`] says.
#[derive(Debug, Clone)]
pub struct Sampler {
    opts: Sampling,
    state: u64,
}

impl Sampler {
    /// A sampler whose draws start from `opts.seed`.
    pub fn new(opts: Sampling) -> Self {
        Sampler {
            opts,
            state: opts.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        }
    }

    /// A uniform draw in [0, 1) (xorshift64, 24 bits).
    fn uniform(&mut self) -> f32 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state >> 40) as f32 / (1u64 << 24) as f32
    }

    /// The next token from `logits`. Logits that are not finite are an error: they mean the
    /// model computed garbage, and any token picked from them would look plausible.
    pub fn pick(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(Error::Invalid("no logits to sample from".into()));
        }
        if let Some(i) = logits.iter().position(|l| !l.is_finite()) {
            return Err(Error::Invalid(format!(
                "the logits are not finite (token {i}: {})",
                logits[i]
            )));
        }
        let o = self.opts;
        if o.temperature <= 0.0 {
            return Ok((0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap_or(0) as u32);
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if o.top_k > 0 {
            idx.truncate(o.top_k);
        }
        let m = logits[idx[0]];
        let mut p: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i] - m) / o.temperature).exp())
            .collect();
        let sum: f32 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= sum);
        let mut cum = 0.0;
        let mut keep = p.len();
        for (i, x) in p.iter().enumerate() {
            cum += x;
            if cum >= o.top_p {
                keep = i + 1;
                break;
            }
        }
        let total: f32 = p[..keep].iter().sum();
        let mut r = self.uniform() * total;
        for (i, x) in p[..keep].iter().enumerate() {
            r -= x;
            if r <= 0.0 {
                return Ok(idx[i] as u32);
            }
        }
        Ok(idx[keep - 1] as u32)
    }
}

/// `generation_config.json`, typed (transformers' `GenerationConfig`): nibble reads the
/// end-of-sequence ids, one or a list (default: none beyond `config.json`'s).
#[derive(Debug, Deserialize)]
struct GenerationConfigFile {
    eos_token_id: Option<TokenIds>,
}

/// The end-of-sequence ids of a model: `config.json`'s and `generation_config.json`'s, read
/// through its folder (locally, over HTTP, in the browser).
pub async fn eos_ids(model: &ModelIndex, cfg: &LlamaConfig) -> Result<Vec<u32>> {
    let mut ids = cfg.eos.clone();
    if let Some(b) = model.read_side("generation_config.json").await? {
        let file = model.locate("generation_config.json");
        let g: GenerationConfigFile = typed_bytes(&file, &b)?;
        if let Some(t) = g.eos_token_id {
            ids.extend(t.ids(&file, "eos_token_id")?);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// How long to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Stop after an end-of-sequence token.
    pub stop_at_eos: bool,
    /// How tokens are picked.
    pub sampling: Sampling,
}

/// One token of a [`Generation`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Token {
    /// The token.
    pub id: u32,
    /// Its index among the generated tokens, from 0.
    pub index: usize,
    /// Figures of the pass that produced its logits (the prefill for token 0).
    pub stats: ExecStats,
    /// Wall time of that pass.
    pub wall: std::time::Duration,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token was generated.
    Stop,
    /// `max_tokens` were generated.
    Length,
}

/// A generation run: the prompt's prefill gives the first token, each later token one decode
/// pass through the KV cache. [`Generation::next_token`] (or `next_token_async` on an event loop) returns the
/// tokens one by one, `None` once finished.
pub struct Generation<B: Backend> {
    decoder: Decoder<B>,
    prompt: Vec<u32>,
    eos: Vec<u32>,
    opts: GenerateOptions,
    sampler: Sampler,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    finish: Option<Finish>,
}

impl<B: Backend> std::fmt::Debug for Generation<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("prompt", &self.prompt.len())
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

impl<B: Backend> Generation<B> {
    /// A run of `decoder` (built for `prompt.len()` tokens and room for `opts.max_tokens` more)
    /// on `prompt`, stopping at `eos` when `opts.stop_at_eos`.
    pub fn new(
        decoder: Decoder<B>,
        prompt: Vec<u32>,
        eos: Vec<u32>,
        opts: GenerateOptions,
    ) -> Result<Self> {
        opts.sampling.check()?;
        if opts.max_tokens == 0 {
            return Err(Error::Invalid("generate at least 1 token".into()));
        }
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt has no tokens".into()));
        }
        let room = decoder.shape.capacity - decoder.shape.prompt;
        if prompt.len() != decoder.shape.prompt || opts.max_tokens > room + 1 {
            return Err(Error::Invalid(format!(
                "the decoder was built for {} prompt tokens and {} more, not {} and {}",
                decoder.shape.prompt,
                room + 1,
                prompt.len(),
                opts.max_tokens
            )));
        }
        Ok(Generation {
            decoder,
            prompt,
            eos,
            sampler: Sampler::new(opts.sampling),
            opts,
            tokens: Vec::new(),
            logits: Vec::new(),
            finish: None,
        })
    }

    /// The next token (the prompt's prefill runs on the first call), `None` once finished.
    pub fn next_token(&mut self) -> Result<Option<Token>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let t0 = web_time::Instant::now();
        let (logits, stats) = match self.tokens.last() {
            None => self.decoder.prefill(&self.prompt)?,
            Some(&prev) => self.decoder.decode(prev)?,
        };
        self.take(logits, stats, t0.elapsed()).map(Some)
    }

    /// [`Generation::next_token`] on an event loop (the browser).
    pub async fn next_token_async(&mut self) -> Result<Option<Token>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let t0 = web_time::Instant::now();
        let (logits, stats) = match self.tokens.last() {
            None => self.decoder.prefill_async(&self.prompt).await?,
            Some(&prev) => self.decoder.decode_async(prev).await?,
        };
        self.take(logits, stats, t0.elapsed()).map(Some)
    }

    fn take(
        &mut self,
        logits: Vec<f32>,
        stats: ExecStats,
        wall: std::time::Duration,
    ) -> Result<Token> {
        let vocab = self.decoder.config.vocab;
        let last = logits.len().checked_sub(vocab).ok_or_else(|| {
            Error::Invalid("the model returned fewer logits than its vocabulary".into())
        })?;
        self.logits = logits;
        let id = self
            .sampler
            .pick(&self.logits[last..])
            .map_err(|e| Error::Invalid(format!("generated token {}: {e}", self.tokens.len())))?;
        self.tokens.push(id);
        if self.opts.stop_at_eos && self.eos.contains(&id) {
            self.finish = Some(Finish::Stop);
        } else if self.tokens.len() >= self.opts.max_tokens {
            self.finish = Some(Finish::Length);
        }
        Ok(Token {
            id,
            index: self.tokens.len() - 1,
            stats,
            wall,
        })
    }

    /// The logits of the last pass (`[prompt, vocab]` for the prefill of a decoder built with
    /// `all_logits`, else `[vocab]`).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// The tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The prompt.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// Why the run ended (`None` while it runs).
    pub fn finish(&self) -> Option<Finish> {
        self.finish
    }

    /// The decoder (its executor: plan, profile, stream limits).
    pub fn decoder(&self) -> &Decoder<B> {
        &self.decoder
    }

    /// The decoder, mutable.
    pub fn decoder_mut(&mut self) -> &mut Decoder<B> {
        &mut self.decoder
    }

    /// Ends the run; gives back the decoder.
    pub fn into_decoder(self) -> Decoder<B> {
        self.decoder
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_largest_and_sampling_follows_the_seed() {
        let logits = [0.5, 2.0, 1.9, -3.0];
        let mut g = Sampler::new(Sampling::default());
        assert_eq!(g.pick(&logits).expect("pick"), 1);
        let s = Sampling {
            temperature: 1.0,
            top_k: 3,
            top_p: 1.0,
            seed: 7,
        };
        let draw = |seed| {
            let mut s1 = Sampler::new(Sampling { seed, ..s });
            (0..64)
                .map(|_| s1.pick(&logits).expect("pick"))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7), "the same seed, the same tokens");
        assert_ne!(draw(7), draw(8));
        assert!(draw(7).iter().all(|&t| t != 3), "top-3 never picks the 4th");
        let mut p = Sampler::new(Sampling { top_p: 0.01, ..s });
        assert!(
            (0..32).all(|_| p.pick(&logits).expect("pick") == 1),
            "top-p keeps the best"
        );
    }

    #[test]
    fn non_finite_logits_and_bad_options_are_errors() {
        let mut g = Sampler::new(Sampling::default());
        assert!(g.pick(&[1.0, f32::NAN]).is_err());
        assert!(g.pick(&[f32::INFINITY, 1.0]).is_err());
        for bad in [
            Sampling {
                temperature: f32::NAN,
                ..Default::default()
            },
            Sampling {
                temperature: -1.0,
                ..Default::default()
            },
            Sampling {
                top_p: 0.0,
                ..Default::default()
            },
            Sampling {
                top_p: f32::NAN,
                ..Default::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }
}
