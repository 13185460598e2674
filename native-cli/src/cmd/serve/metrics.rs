//! The API server's counters, served at `GET /metrics` in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Counters and gauges; the engine and the handlers update them, `/metrics` reads them.
#[derive(Debug, Default)]
pub(super) struct Metrics {
    /// Requests answered, by (endpoint, status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Requests waiting for a sequence slot.
    pub queue_depth: AtomicU64,
    /// Sequences holding a slot.
    pub active: AtomicU64,
    /// Decode passes and the sequences they computed (their ratio: the mean batch size).
    pub decode_passes: AtomicU64,
    pub decode_rows: AtomicU64,
    /// Sequences in the last decode pass, and the most in any.
    pub batch_size: AtomicU64,
    pub batch_size_max: AtomicU64,
    /// Prefill passes (one chunk of one prompt each).
    pub prefill_passes: AtomicU64,
    /// Mixed passes (prompt tokens of several sequences beside decoded ones).
    pub mixed_passes: AtomicU64,
    /// Weight bytes read from the source (streamed groups) and uploaded from the host tier.
    pub bytes_streamed: AtomicU64,
    pub bytes_host_tier: AtomicU64,
    /// Time in passes over the weights, in microseconds, and their count.
    pub step_micros: AtomicU64,
    pub steps: AtomicU64,
    /// Sequences ended by stop / length, by the client going away, by an error.
    pub finished: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    /// Requests refused because the queue was full.
    pub rejected: AtomicU64,
}

impl Metrics {
    /// Counts one answered request.
    pub fn request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_default() += 1;
        }
    }

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

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP nibble_{name} {help}");
            let _ = writeln!(s, "# TYPE nibble_{name} {kind}");
            let _ = writeln!(s, "nibble_{name} {v}");
        };
        let g = |a: &AtomicU64| a.load(Relaxed) as f64;
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            g(&self.prompt_tokens),
        );
        metric(
            "completion_tokens_total",
            "counter",
            "Tokens generated.",
            g(&self.completion_tokens),
        );
        metric(
            "queue_depth",
            "gauge",
            "Requests waiting for a sequence slot.",
            g(&self.queue_depth),
        );
        metric(
            "active_sequences",
            "gauge",
            "Sequences holding a KV cache slot.",
            g(&self.active),
        );
        metric(
            "decode_passes_total",
            "counter",
            "Decode passes over the weights.",
            g(&self.decode_passes),
        );
        metric(
            "decode_rows_total",
            "counter",
            "Sequences computed by decode passes (rows / passes = mean batch size).",
            g(&self.decode_rows),
        );
        metric(
            "batch_size",
            "gauge",
            "Sequences in the last decode pass.",
            g(&self.batch_size),
        );
        metric(
            "batch_size_max",
            "gauge",
            "Most sequences in one decode pass.",
            g(&self.batch_size_max),
        );
        metric(
            "prefill_passes_total",
            "counter",
            "Prefill passes (one prompt chunk each).",
            g(&self.prefill_passes),
        );
        metric(
            "mixed_passes_total",
            "counter",
            "Mixed passes (prompt tokens of several sequences beside decoded ones).",
            g(&self.mixed_passes),
        );
        metric(
            "bytes_streamed_total",
            "counter",
            "Weight bytes read from the source for streamed groups.",
            g(&self.bytes_streamed),
        );
        metric(
            "bytes_host_tier_total",
            "counter",
            "Weight bytes uploaded from the host tier.",
            g(&self.bytes_host_tier),
        );
        metric(
            "step_seconds_total",
            "counter",
            "Seconds spent in passes over the weights.",
            g(&self.step_micros) / 1e6,
        );
        metric(
            "steps_total",
            "counter",
            "Passes over the weights.",
            g(&self.steps),
        );
        metric(
            "sequences_finished_total",
            "counter",
            "Sequences ended by a stop or their length.",
            g(&self.finished),
        );
        metric(
            "sequences_cancelled_total",
            "counter",
            "Sequences freed because the client went away.",
            g(&self.cancelled),
        );
        metric(
            "sequences_failed_total",
            "counter",
            "Sequences ended by an error.",
            g(&self.failed),
        );
        metric(
            "requests_rejected_total",
            "counter",
            "Requests refused with 503 (queue full).",
            g(&self.rejected),
        );
        let _ = writeln!(
            s,
            "# HELP nibble_requests_total Requests answered, by endpoint and status."
        );
        let _ = writeln!(s, "# TYPE nibble_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(
                    s,
                    "nibble_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
                );
            }
        }
        s
    }
}
