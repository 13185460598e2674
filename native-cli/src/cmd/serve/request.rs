//! The API server's request bodies, typed as OpenAI's API documents them: the fields nibble
//! reads (others are ignored); a field of the wrong type is a 400 naming it.

use serde::Deserialize;

/// A string or a list of strings (`stop`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub(super) fn list(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// Sampling and length fields common to chat and completions.
#[derive(Debug, Deserialize)]
pub(super) struct Common {
    pub(super) model: Option<String>,
    pub(super) max_tokens: Option<u64>,
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) temperature: Option<f32>,
    pub(super) top_p: Option<f32>,
    pub(super) seed: Option<u64>,
    pub(super) stop: Option<OneOrMany>,
    pub(super) n: Option<u64>,
    #[serde(default)]
    pub(super) stream: bool,
    pub(super) stream_options: Option<StreamOptions>,
    /// Not OpenAI's (vLLM's): generate past end-of-sequence tokens, to `max_tokens` (benchmarks).
    #[serde(default)]
    pub(super) ignore_eos: bool,
}

#[derive(Debug, Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatRequest {
    pub(super) messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub(super) common: Common,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatMessage {
    pub(super) role: String,
    pub(super) content: Option<Content>,
}

/// A message's content: text, or parts of which the text ones are read.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub(super) struct Part {
    #[serde(rename = "type")]
    pub(super) kind: String,
    pub(super) text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(super) struct CompletionRequest {
    pub(super) prompt: Prompt,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// A completion's prompt: text, token ids, or a list of one of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// How many inputs it holds (known before any is tokenized).
    pub(super) fn count(&self) -> usize {
        match self {
            Prompt::Text(_) | Prompt::Ids(_) => 1,
            Prompt::Texts(t) => t.len(),
            Prompt::IdLists(l) => l.len(),
        }
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct EmbeddingRequest {
    pub(super) model: Option<String>,
    pub(super) input: Prompt,
    pub(super) encoding_format: Option<String>,
    pub(super) dimensions: Option<u64>,
}
