//! Continuous batching: the engine a server runs on one thread, owning the [`BatchDecoder`] and
//! running passes over the weights while any sequence is active. The transport (HTTP, SSE,
//! metrics exposition) stays with the server: requests come as [`Job`]s whose events go to an
//! [`EventSink`], and the engine's figures are [`BatchCounters`].
//!
//! Requests arrive as [`Job`]s; each waits (in a bounded queue, see [`Shared::admit`]) for a
//! free KV cache slot. While no prompt is pending, each pass decodes the next token of every
//! sequence. A prompt joins between passes: alone it is prefilled in chunk passes of its own;
//! beside other sequences, mixed passes take a few of its tokens (and of every other pending
//! prompt) together with the next token of every decoding sequence, so that nobody waits and the
//! weights are read once for all. Each
//! token is sampled with the request's own sampler, turned into text (held back while it may be
//! the start of a stop string or an incomplete UTF-8 character) and sent to the request's
//! channel. A sequence whose channel is closed (the client went away) is dropped before the next
//! pass and its slot freed; so is one that finishes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::exec::ExecStats;
use crate::models::llama::{BatchDecoder, Sampler, Sampling};
use crate::models::text::{TextStream, TextTokenizer};

/// Where a job's events go (a server's channel to its client).
pub trait EventSink: Send {
    /// Sends an event; `false` when the receiver is gone.
    fn send(&self, event: Event) -> bool;
    /// Whether the receiver is gone (the client went away).
    fn is_closed(&self) -> bool;
}

/// The engine's counters and gauges: the engine and the server's handlers update them; a
/// server exposes them (Prometheus text, JSON).
#[derive(Debug, Default)]
pub struct BatchCounters {
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub completion_tokens: AtomicU64,
    /// Requests waiting for a sequence slot.
    pub queue_depth: AtomicU64,
    /// Sequences holding a slot.
    pub active: AtomicU64,
    /// Decode passes.
    pub decode_passes: AtomicU64,
    /// Sequences computed by decode passes (rows / passes: the mean batch size).
    pub decode_rows: AtomicU64,
    /// Sequences in the last decode pass.
    pub batch_size: AtomicU64,
    /// The most sequences in any decode pass.
    pub batch_size_max: AtomicU64,
    /// Prefill passes (one chunk of one prompt each).
    pub prefill_passes: AtomicU64,
    /// Mixed passes (prompt tokens of several sequences beside decoded ones).
    pub mixed_passes: AtomicU64,
    /// Weight bytes read from the source (streamed groups).
    pub bytes_streamed: AtomicU64,
    /// Weight bytes uploaded from the host tier.
    pub bytes_host_tier: AtomicU64,
    /// Time in passes over the weights, in microseconds.
    pub step_micros: AtomicU64,
    /// Passes over the weights.
    pub steps: AtomicU64,
    /// Sequences ended by a stop or their length.
    pub finished: AtomicU64,
    /// Sequences freed because the client went away.
    pub cancelled: AtomicU64,
    /// Sequences ended by an error.
    pub failed: AtomicU64,
    /// Requests refused because every slot and queue place was taken.
    pub rejected: AtomicU64,
}

impl BatchCounters {
    /// One pass over the weights that took `secs`, moving these bytes.
    pub fn pass(&self, secs: f64, streamed: u64, host: u64) {
        self.steps.fetch_add(1, Relaxed);
        self.step_micros.fetch_add((secs * 1e6) as u64, Relaxed);
        self.bytes_streamed.fetch_add(streamed, Relaxed);
        self.bytes_host_tier.fetch_add(host, Relaxed);
    }

    /// A decode pass over `rows` sequences.
    pub fn decode_pass(&self, rows: u64) {
        self.decode_passes.fetch_add(1, Relaxed);
        self.decode_rows.fetch_add(rows, Relaxed);
        self.batch_size.store(rows, Relaxed);
        self.batch_size_max.fetch_max(rows, Relaxed);
    }
}

/// What a request asks the engine for.
pub struct Job {
    /// Prompt token ids (checked: 1 to context - max_tokens).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How each token is picked.
    pub sampling: Sampling,
    /// Strings that end the completion (not included in it).
    pub stop: Vec<String>,
    /// End at an end-of-sequence token (else it is text like any other).
    pub stop_at_eos: bool,
    /// The LoRA adapter the sequence runs with (an index into the model's adapters; `None`:
    /// the base model alone).
    pub adapter: Option<usize>,
    /// Where the text goes; closed when the client goes away.
    pub events: Box<dyn EventSink>,
}

/// What the engine sends back for a job.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The next piece of the completion.
    Text(String),
    /// The completion ended.
    Done {
        /// `stop` (an end-of-sequence token or a stop string) or `length`.
        finish: &'static str,
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Tokens generated (an end-of-sequence token included).
        completion_tokens: usize,
    },
    /// The engine failed on this request.
    Error(String),
}

/// State shared by the engine and the request handlers.
#[derive(Debug)]
pub struct Shared {
    /// The engine's figures.
    pub counters: BatchCounters,
    /// Jobs submitted and not yet ended (waiting or holding a slot).
    load: AtomicU64,
    /// Slots + the queue: more jobs than this are refused.
    capacity: u64,
}

impl Shared {
    /// For `slots` sequences and a queue of `queue` more.
    pub fn new(slots: u64, queue: u64) -> Self {
        Shared {
            counters: BatchCounters::default(),
            load: AtomicU64::new(0),
            capacity: slots + queue,
        }
    }

    /// Takes a place for one more job, or `false` when every slot and queue place is taken.
    pub fn admit(&self) -> bool {
        if self.load.fetch_add(1, Relaxed) >= self.capacity {
            self.load.fetch_sub(1, Relaxed);
            self.counters.rejected.fetch_add(1, Relaxed);
            return false;
        }
        true
    }

    fn ended(&self) {
        self.load.fetch_sub(1, Relaxed);
    }

    /// Gives back a place taken by [`Shared::admit`] for work the engine never sees (the API
    /// server's embeddings go through the same admission).
    pub fn release(&self) {
        self.ended();
    }
}

/// A job in a slot.
struct Seq {
    job: Job,
    slot: usize,
    /// Prompt tokens in the cache.
    fed: usize,
    tokens: Vec<u32>,
    /// The last sampled token, to be fed by the next decode pass.
    next: Option<u32>,
    sampler: Sampler,
    out: Completion,
}

/// A completion's text as the server sends it: tokens through the incremental detokenizer that
/// `nibble run` uses ([`TextStream`]: whole characters only, byte-fallback runs held until they
/// close), then held back while the tail may begin a stop string. The pieces joined equal the
/// decoded tokens, up to a stop string.
#[derive(Debug, Default)]
pub struct Completion {
    /// The text so far, as the detokenizer released it.
    text: String,
    detok: TextStream,
    /// Bytes of `text` sent so far.
    sent: usize,
}

impl Completion {
    /// Takes the next token (`None`: the end-of-sequence token, which has no text); `last` when
    /// the completion ends with it. Returns the text to send now and whether a stop string
    /// ended the completion.
    pub fn next(
        &mut self,
        tok: &TextTokenizer,
        id: Option<u32>,
        last: bool,
        stop: &[String],
    ) -> crate::error::Result<(String, bool)> {
        if let Some(id) = id {
            let piece = self.detok.push(tok, id)?;
            self.text.push_str(&piece);
        }
        if last {
            let tail = self.detok.finish(tok)?;
            self.text.push_str(&tail);
        }
        // The last piece includes what was held back for a stop string that did not come.
        let (upto, stopped) = sendable(&self.text, self.sent, stop, last);
        let piece = self.text[self.sent..upto.max(self.sent)].to_string();
        self.sent = upto.max(self.sent);
        Ok((piece, stopped))
    }
}

/// The engine: the decoder, the tokenizer and the sequences.
pub struct Engine<B: Backend> {
    dec: BatchDecoder<B>,
    tok: Arc<TextTokenizer>,
    eos: Vec<u32>,
    jobs: std::sync::mpsc::Receiver<Job>,
    waiting: VecDeque<Job>,
    seqs: Vec<Option<Seq>>,
    shared: Arc<Shared>,
}

impl<B: Backend> Engine<B> {
    /// The engine over `dec`, taking jobs from `jobs`; `eos` ends a sequence that asks for it.
    pub fn new(
        dec: BatchDecoder<B>,
        tok: Arc<TextTokenizer>,
        eos: Vec<u32>,
        jobs: std::sync::mpsc::Receiver<Job>,
        shared: Arc<Shared>,
    ) -> Self {
        let slots = dec.shape.slots;
        Engine {
            dec,
            tok,
            eos,
            jobs,
            waiting: VecDeque::new(),
            seqs: (0..slots).map(|_| None).collect(),
            shared,
        }
    }

    /// Runs until every job sender is gone; gives back the decoder.
    pub fn run(mut self) -> BatchDecoder<B> {
        loop {
            let idle = self.waiting.is_empty() && self.seqs.iter().all(Option::is_none);
            if idle {
                match self.jobs.recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(_) => return self.dec,
                }
            }
            while let Ok(j) = self.jobs.try_recv() {
                self.waiting.push_back(j);
            }
            self.drop_gone();
            self.admit();
            self.pass();
        }
    }

    fn m(&self) -> &BatchCounters {
        &self.shared.counters
    }

    /// Drops waiting jobs and sequences whose client went away; frees their slots.
    fn drop_gone(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        for _ in self.waiting.len()..before {
            self.m().cancelled.fetch_add(1, Relaxed);
            self.shared.ended();
        }
        for s in 0..self.seqs.len() {
            if self.seqs[s]
                .as_ref()
                .is_some_and(|q| q.job.events.is_closed())
            {
                self.m().cancelled.fetch_add(1, Relaxed);
                let _ = self.free(s);
            }
        }
        self.gauges();
    }

    fn gauges(&self) {
        let active = self.seqs.iter().filter(|s| s.is_some()).count() as u64;
        self.m().active.store(active, Relaxed);
        self.m()
            .queue_depth
            .store(self.waiting.len() as u64, Relaxed);
    }

    /// Frees `slot`: its sequence, if it held one.
    fn free(&mut self, slot: usize) -> Option<Seq> {
        let seq = self.seqs[slot].take();
        if seq.is_some() {
            self.dec.reset(slot);
            self.shared.ended();
        }
        seq
    }

    /// Moves waiting jobs into free slots (the lowest first, so that passes use the smallest
    /// batch program).
    fn admit(&mut self) {
        for slot in 0..self.seqs.len() {
            if self.seqs[slot].is_some() {
                continue;
            }
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            self.m()
                .prompt_tokens
                .fetch_add(job.prompt.len() as u64, Relaxed);
            self.dec.reset(slot);
            if let Err(e) = self.dec.set_adapter(slot, job.adapter) {
                job.events.send(Event::Error(e.to_string()));
                self.m().failed.fetch_add(1, Relaxed);
                self.shared.ended();
                continue;
            }
            self.seqs[slot] = Some(Seq {
                sampler: Sampler::new(job.sampling),
                job,
                slot,
                fed: 0,
                tokens: Vec::new(),
                next: None,
                out: Completion::default(),
            });
        }
        self.gauges();
    }

    fn pass_done(&self, t0: Instant, stats: &ExecStats) {
        self.m().pass(
            t0.elapsed().as_secs_f64(),
            stats.source_bytes,
            stats.host_bytes,
        );
    }

    /// One round: a decode pass, chunk passes of a lone prompt, or a mixed pass.
    fn pass(&mut self) {
        let prompting = self
            .seqs
            .iter()
            .flatten()
            .filter(|s| s.fed < s.job.prompt.len())
            .count();
        let decoding = self.seqs.iter().flatten().any(|s| s.next.is_some());
        if prompting == 0 {
            self.decode();
        } else if !self.dec.has_mixed() || (!decoding && prompting == 1) {
            self.prefill();
            self.decode();
        } else {
            self.mixed();
        }
    }

    /// One mixed pass: the next prompt tokens of every sequence in its prompt and the next
    /// token of every decoding one.
    fn mixed(&mut self) {
        let mix = self.dec.shape.mix;
        let mut feeds = Vec::new();
        let mut decoded = 0;
        for seq in self.seqs.iter_mut().flatten() {
            if seq.fed < seq.job.prompt.len() {
                let end = (seq.fed + mix).min(seq.job.prompt.len());
                feeds.push((seq.slot, seq.job.prompt[seq.fed..end].to_vec()));
                seq.fed = end;
            } else if let Some(t) = seq.next.take() {
                feeds.push((seq.slot, vec![t]));
                decoded += 1;
            }
        }
        if feeds.is_empty() {
            return;
        }
        let t0 = Instant::now();
        match self.dec.step_mixed(&feeds) {
            Ok((logits, stats)) => {
                self.pass_done(t0, &stats);
                self.m().mixed_passes.fetch_add(1, Relaxed);
                if decoded > 0 {
                    self.m().decode_pass(decoded);
                }
                for ((slot, _), l) in feeds.iter().zip(logits) {
                    let done = self.seqs[*slot]
                        .as_ref()
                        .is_some_and(|s| s.fed >= s.job.prompt.len());
                    if done {
                        self.take(*slot, &l);
                    }
                }
            }
            Err(e) => {
                for (slot, _) in feeds {
                    self.fail(slot, e.to_string());
                }
            }
        }
    }

    /// One prefill chunk of every sequence still in its prompt.
    fn prefill(&mut self) {
        let chunk = self.dec.shape.chunk;
        for slot in 0..self.seqs.len() {
            let Some(seq) = self.seqs[slot].as_ref() else {
                continue;
            };
            if seq.fed >= seq.job.prompt.len() {
                continue;
            }
            let end = (seq.fed + chunk).min(seq.job.prompt.len());
            let ids = seq.job.prompt[seq.fed..end].to_vec();
            let t0 = Instant::now();
            let r = self.dec.prefill(slot, &ids);
            self.m().prefill_passes.fetch_add(1, Relaxed);
            match r {
                Ok((logits, stats)) => {
                    self.pass_done(t0, &stats);
                    if let Some(seq) = self.seqs[slot].as_mut() {
                        seq.fed = end;
                    }
                    if end == self.seqs[slot].as_ref().map_or(0, |s| s.job.prompt.len()) {
                        self.take(slot, &logits);
                    }
                }
                Err(e) => self.fail(slot, e.to_string()),
            }
        }
    }

    /// One decode pass over every sequence past its prompt.
    fn decode(&mut self) {
        let rows: Vec<(usize, u32)> = self
            .seqs
            .iter()
            .flatten()
            .filter_map(|s| s.next.map(|t| (s.slot, t)))
            .collect();
        if rows.is_empty() {
            return;
        }
        let t0 = Instant::now();
        match self.dec.decode(&rows) {
            Ok((logits, stats)) => {
                self.pass_done(t0, &stats);
                self.m().decode_pass(rows.len() as u64);
                for ((slot, _), l) in rows.iter().zip(logits) {
                    self.take(*slot, &l);
                }
            }
            Err(e) => {
                for (slot, _) in rows {
                    self.fail(slot, e.to_string());
                }
            }
        }
    }

    fn fail(&mut self, slot: usize, msg: String) {
        self.m().failed.fetch_add(1, Relaxed);
        let seq = self.free(slot);
        self.gauges();
        if let Some(seq) = seq {
            let _ = seq.job.events.send(Event::Error(msg));
        }
    }

    /// Samples the next token of the sequence in `slot` from `logits`, sends its text, and ends
    /// the sequence at an end-of-sequence token, a stop string or its length.
    fn take(&mut self, slot: usize, logits: &[f32]) {
        let Some(seq) = self.seqs[slot].as_mut() else {
            return;
        };
        let id = match seq.sampler.pick(logits) {
            Ok(id) => id,
            Err(e) => return self.fail(slot, e.to_string()),
        };
        self.shared.counters.completion_tokens.fetch_add(1, Relaxed);
        let eos = seq.job.stop_at_eos && self.eos.contains(&id);
        if !eos {
            seq.tokens.push(id);
        }
        let generated = seq.tokens.len() + usize::from(eos);
        let last = eos || generated >= seq.job.max_tokens;
        let stopped = match seq
            .out
            .next(&self.tok, (!eos).then_some(id), last, &seq.job.stop)
        {
            Ok((piece, stopped)) => {
                if !piece.is_empty() {
                    let _ = seq.job.events.send(Event::Text(piece));
                }
                stopped
            }
            Err(e) => return self.fail(slot, e.to_string()),
        };
        let finish = if stopped || eos {
            Some("stop")
        } else if last {
            Some("length")
        } else {
            None
        };
        match finish {
            Some(f) => {
                // The slot is free before the client hears of the end, so that its next
                // request finds it free.
                let done = Event::Done {
                    finish: f,
                    prompt_tokens: seq.job.prompt.len(),
                    completion_tokens: generated,
                };
                self.m().finished.fetch_add(1, Relaxed);
                let seq = self.free(slot);
                self.gauges();
                if let Some(seq) = seq {
                    let _ = seq.job.events.send(done);
                }
            }
            None => seq.next = Some(id),
        }
    }
}

/// How far `text` may be sent (a byte offset at a character boundary, at least `sent`), and
/// whether a stop string ended it: up to the first stop string at or after what was sent, else
/// all but a tail that may begin a stop string (all of it when `last`). `text` holds whole
/// characters only ([`TextStream`] holds back the rest).
fn sendable(text: &str, sent: usize, stop: &[String], last: bool) -> (usize, bool) {
    let sent = sent.min(text.len());
    let longest = stop.iter().map(String::len).max().unwrap_or(0);
    let mut from = sent.saturating_sub(longest);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    let first = stop
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
        .min();
    if let Some(at) = first {
        return (at.max(sent), true);
    }
    let mut end = text.len();
    if !last {
        // The longest tail of text[..end] that is a proper prefix of a stop string.
        let hold = stop
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|p| text[..end].ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        end -= hold;
    }
    (end.max(sent), false)
}

#[cfg(test)]
mod tests {
    use super::sendable;

    #[test]
    fn text_is_held_back_while_it_may_begin_a_stop_string() {
        let stop = vec!["\n\nUser:".to_string(), "END".to_string()];
        assert_eq!(sendable("Hello", 0, &stop, false), (5, false));
        assert_eq!(sendable("Hello\n", 0, &stop, false), (5, false));
        assert_eq!(sendable("Hello\n\nUs", 5, &stop, false), (5, false));
        assert_eq!(sendable("Hello\n\nUser: x", 5, &stop, false), (5, true));
        assert_eq!(sendable("Hello EN", 0, &stop, false), (6, false));
        assert_eq!(sendable("Hello EN", 0, &stop, true), (8, false));
        assert_eq!(sendable("a END b", 0, &stop, false), (2, true));
        assert_eq!(sendable("ab", 0, &[], false), (2, false));
        // A stop string that begins inside a multi-byte character's text.
        assert_eq!(
            sendable("x\u{20ac}y", 1, &["\u{20ac}".into()], false),
            (1, true)
        );
    }
}
