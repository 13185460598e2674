//! Text in and out of a language model: `tokenizer.json` through the `tokenizers` crate and the
//! chat template of `tokenizer_config.json` (or `chat_template.jinja`) rendered with minijinja the
//! way transformers' `apply_chat_template` renders it (trim_blocks, lstrip_blocks, Python string
//! methods, `raise_exception`).

use crate::error::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's tokenizer and chat template.
pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.tok.get_vocab_size(true))
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Model {
        file: what.into(),
        msg: e.to_string(),
    }
}

/// Runs a call into the `tokenizers` crate behind nibble's panic boundary
/// ([`crate::error::guarded`]): the crate panics on some malformed files (a bad
/// `precompiled_charsmap`, T5's normalizer and many LLMs'), and a file from a model folder must
/// give an error that names it, not end the process (or the server).
pub(crate) fn guarded<T>(
    file: &str,
    f: impl FnOnce() -> std::result::Result<T, tokenizers::Error>,
) -> Result<T> {
    crate::error::guarded(file, "the tokenizer library", f)
}

/// `tokenizer.json` parsed behind the panic boundary; `file` names it in errors.
pub(crate) fn parse_tokenizer(json: &[u8], file: &str) -> Result<tokenizers::Tokenizer> {
    guarded(file, || tokenizers::Tokenizer::from_bytes(json))
}

/// A special token as tokenizer_config.json writes it: a string, or `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

impl TextTokenizer {
    /// From the bytes of `tokenizer.json`, and optionally `tokenizer_config.json` and a
    /// `chat_template.jinja` (used when the config has no template).
    pub fn from_parts(
        tokenizer_json: &[u8],
        tokenizer_config: Option<&[u8]>,
        chat_template_file: Option<&[u8]>,
    ) -> Result<Self> {
        let mut tok = parse_tokenizer(tokenizer_json, "tokenizer.json")?;
        // Ids are laid out by the caller: no padding (a BERT tokenizer.json often pads every
        // text to a fixed length, which transformers and sentence-transformers override too).
        tok.with_padding(None);
        let cfg: Option<serde_json::Value> = tokenizer_config
            .map(serde_json::from_slice)
            .transpose()
            .map_err(|e| err("tokenizer_config.json", e))?;
        let template = cfg.as_ref().and_then(|c| match c.get("chat_template")? {
            serde_json::Value::String(s) => Some(s.clone()),
            // A list of named templates: the "default" one, else the first.
            serde_json::Value::Array(a) => a
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| a.first())
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => None,
        });
        let template = template
            .or_else(|| chat_template_file.map(|b| String::from_utf8_lossy(b).into_owned()));
        Ok(TextTokenizer {
            tok,
            chat_template: template,
            bos_token: cfg.as_ref().and_then(|c| token_text(c.get("bos_token"))),
            eos_token: cfg.as_ref().and_then(|c| token_text(c.get("eos_token"))),
        })
    }

    /// Loads the tokenizer files of a model (`tokenizer.json`, `tokenizer_config.json`, and
    /// `chat_template.jinja` when the config has no template) through its folder, locally, over
    /// HTTP or in the browser; `None` when the model has no `tokenizer.json`.
    pub async fn load(model: &crate::io::model::ModelIndex) -> Result<Option<Self>> {
        let Some(json) = model.read_side("tokenizer.json").await? else {
            return Ok(None);
        };
        let cfg = model.read_side("tokenizer_config.json").await?;
        let has_template = cfg.as_ref().is_some_and(|c| {
            serde_json::from_slice::<serde_json::Value>(c)
                .is_ok_and(|v| v.get("chat_template").is_some())
        });
        let tpl = if has_template {
            None
        } else {
            model.read_side("chat_template.jinja").await?
        };
        Self::from_parts(&json, cfg.as_deref(), tpl.as_deref()).map(Some)
    }

    /// [`TextTokenizer::load`] natively; a model without `tokenizer.json` is an error.
    #[cfg(feature = "native")]
    pub fn for_model(model: &crate::io::model::ModelIndex) -> Result<Self> {
        crate::io::folder::block_on(Self::load(model))?.ok_or_else(|| Error::Model {
            file: model.locate("tokenizer.json"),
            msg: "not found: this model has no tokenizer (use --prompt-ids)".into(),
        })
    }

    /// The prompt ids of `text`: as the user's turn of the chat template, ready for the
    /// assistant's answer, with `chat` (the template adds the special tokens); else the text as
    /// `tokenizer(text)` encodes it.
    pub fn prompt_ids(&self, text: &str, chat: bool) -> Result<Vec<u32>> {
        if chat {
            let rendered = self.apply_chat_template(&[Message::new("user", text)], true)?;
            self.encode(&rendered, false)
        } else {
            self.encode(text, true)
        }
    }

    /// Cuts longer texts to `max_len` tokens (special tokens included), as sentence-transformers
    /// does at its `max_seq_length`; `None`: no cut.
    pub fn set_max_len(&mut self, max_len: Option<usize>) -> Result<()> {
        let params = max_len.map(|max_length| tokenizers::TruncationParams {
            max_length,
            ..Default::default()
        });
        self.tok
            .with_truncation(params)
            .map_err(|e| err("tokenizer truncation", e))?;
        Ok(())
    }

    /// Token ids of `text`; `add_special` lets the tokenizer's post-processor add BOS/EOS the way
    /// `tokenizer(text)` does.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let e = guarded("tokenizer.json", || self.tok.encode(text, add_special))?;
        Ok(e.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens dropped when `skip_special`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        guarded("tokenizer.json", || self.tok.decode(ids, skip_special))
    }

    /// Whether `id` is a byte-fallback token (`<0xNN>`, SentencePiece's spelling of one byte).
    pub fn is_byte_token(&self, id: u32) -> bool {
        self.tok.id_to_token(id).is_some_and(|t| {
            t.len() == 6
                && t.starts_with("<0x")
                && t.ends_with('>')
                && u8::from_str_radix(&t[3..5], 16).is_ok()
        })
    }

    /// The id of a token's text, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }

    /// Whether the tokenizer came with a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The conversation rendered by the chat template (as `apply_chat_template(...,
    /// tokenize=False)`), ending with the assistant's turn when `add_generation_prompt`.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tpl = self.chat_template.as_deref().ok_or_else(|| Error::Model {
            file: "tokenizer_config.json".into(),
            msg: "no chat_template: this model has no chat format (drop --chat)".into(),
        })?;
        let mut env = minijinja::Environment::new();
        // A template is code from the model folder: it runs on a budget of instructions and of
        // output, so that nested loops or a loop that prints are an error, not a hang or an
        // abort. (Strings a template builds without writing them are bounded by the fuel and
        // minijinja's own limits only.) Real templates take a few thousand instructions per
        // message.
        let text_bytes: usize = messages.iter().map(|m| m.content.len()).sum();
        env.set_fuel(Some(TEMPLATE_FUEL + 64 * text_bytes as u64));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", tpl)
            .map_err(|e| err("chat template", e))?;
        let t = env
            .get_template("chat")
            .map_err(|e| err("chat template", e))?;
        let mut out = Limited {
            buf: Vec::new(),
            limit: TEMPLATE_OUTPUT + 4 * text_bytes,
        };
        t.render_captured_to(
            minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            },
            &mut out,
        )
        .map(drop)
        .map_err(|e| {
            let e = match e.kind() {
                minijinja::ErrorKind::OutOfFuel => format!(
                    "{e}: the template ran more than {} instructions for {} messages",
                    TEMPLATE_FUEL + 64 * text_bytes as u64,
                    messages.len()
                ),
                minijinja::ErrorKind::WriteFailure => format!(
                    "the template wrote more than {} bytes for {} messages",
                    out.limit,
                    messages.len()
                ),
                _ => e.to_string(),
            };
            err("chat template", e)
        })?;
        String::from_utf8(out.buf).map_err(|_| err("chat template", "output is not UTF-8"))
    }
}

/// Instructions a chat template may run beyond 64 per byte of the messages.
const TEMPLATE_FUEL: u64 = 10_000_000;
/// Bytes a chat template may write beyond 4 per byte of the messages.
const TEMPLATE_OUTPUT: usize = 1 << 20;

/// A writer that refuses to grow past `limit` bytes.
struct Limited {
    buf: Vec<u8>,
    limit: usize,
}

impl std::io::Write for Limited {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.limit {
            return Err(std::io::Error::other("output limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Turns generated tokens into text as they arrive, the one detokenizer of `nibble run`, the
/// API server and the browser. Each call returns only text that is final: a character still
/// incomplete (a byte-level BPE token, or SentencePiece's `<0xNN>` byte-fallback tokens, which
/// decode to one U+FFFD per byte until the character is whole) is held back until a later token
/// completes it or [`TextStream::finish`] ends the stream. A run of `<0xNN>` tokens is held
/// until a token of another kind closes it, because the ByteFallback decoder turns the whole run
/// into U+FFFD when any byte of it is invalid: a character sent early could be wrong later. So
/// the text released, put together, equals the decode of every token. Like text-generation-inference, it
/// decodes a short window (from the token before the last text it released), so a step costs the
/// same at token 5 and at token 5,000 and SentencePiece's leading-space rule sees the same first
/// token in both decodes.
#[derive(Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Where the window decoded for each token starts.
    prefix: usize,
    /// Tokens whose text has been released.
    read: usize,
}

impl TextStream {
    /// Adds a token; returns the text it completes (often empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.release(tok, false)
    }

    /// Ends the stream: returns whatever was held back (an incomplete character decodes to
    /// U+FFFD, as the whole token list would).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String> {
        self.release(tok, true)
    }

    fn release(&mut self, tok: &TextTokenizer, last: bool) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        let open_bytes = self.ids.last().is_some_and(|&id| tok.is_byte_token(id));
        if !last && (now.len() <= before.len() || now.ends_with('\u{fffd}') || open_bytes) {
            return Ok(String::new());
        }
        // `now` extends `before`, except where a later token changed how earlier ones decode (a
        // byte group that turned out invalid): what was sent stays, and the text goes on from
        // the same length, at a character boundary.
        let mut from = before.len();
        while from < now.len() && !now.is_char_boundary(from) {
            from += 1;
        }
        let new = now.get(from..).unwrap_or("").to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(new)
    }
}
