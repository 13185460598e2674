//! Chat templates are code from the model folder (fault class 16): they run on a budget of
//! instructions and of output, so that a template that loops without end or prints without
//! end is an error in bounded time and memory, while real templates render as before.
//! Generated text comes out whole (#32 faults 1-2): the detokenizer that `nibble run`, the API
//! server and the browser share releases only complete characters, and what it releases adds up
//! to the decode of every token, with SentencePiece's byte-fallback tokens too.

use nibble_core::models::text::{Message, TextStream, TextTokenizer};
use nibble_tests::fixture;
use nibble_tests::text::{byte_fallback_tokenizer, byte_id, byte_ids, WORD_A};

fn tokenizer(template: &str) -> TextTokenizer {
    let json = std::fs::read(fixture("minilm-nf4/model/tokenizer.json")).expect("tokenizer.json");
    let cfg = serde_json::json!({ "chat_template": template, "bos_token": "[CLS]" });
    TextTokenizer::from_parts(&json, Some(cfg.to_string().as_bytes()), None).expect("tokenizer")
}

fn render(template: &str, content: &str) -> (Result<String, String>, std::time::Duration) {
    let t0 = std::time::Instant::now();
    let r = tokenizer(template)
        .apply_chat_template(&[Message::new("user", content)], true)
        .map_err(|e| e.to_string());
    (r, t0.elapsed())
}

#[test]
fn a_template_that_never_ends_runs_out_of_fuel() {
    let (r, took) = render(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "hi",
    );
    let e = r.expect_err("nested loops of 10^10 iterations");
    assert!(
        e.contains("chat template") && e.contains("instructions"),
        "{e}"
    );
    assert!(took.as_secs() < 30, "took {took:?}");
}

#[test]
fn a_template_that_prints_without_end_hits_the_output_limit() {
    let content = "x".repeat(1000);
    let (r, took) = render(
        "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
        &content,
    );
    let e = r.expect_err("100 MB of output");
    assert!(e.contains("chat template") && e.contains("bytes"), "{e}");
    assert!(took.as_secs() < 30, "took {took:?}");
}

#[test]
fn real_templates_render_within_the_budget() {
    // ChatML, as SmolLM2 and Qwen2 write it, over a long message.
    let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
                  message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if \
                  add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    let content = "word ".repeat(200_000);
    let (r, _) = render(chatml, &content);
    let out = r.expect("a 1 MB message renders");
    assert!(out.starts_with("<|im_start|>user\nword word"));
    assert!(out.ends_with("<|im_end|>\n<|im_start|>assistant\n"));
}

fn byte_fallback() -> TextTokenizer {
    let json = byte_fallback_tokenizer(300).to_string();
    TextTokenizer::from_parts(json.as_bytes(), None, None).expect("tokenizer")
}

/// Streams `ids`; returns the pieces, checked to add up to the decode of all of them.
fn stream(tok: &TextTokenizer, ids: &[u32]) -> Vec<String> {
    let mut s = TextStream::default();
    let mut pieces: Vec<String> = ids
        .iter()
        .map(|&id| s.push(tok, id).expect("push"))
        .collect();
    pieces.push(s.finish(tok).expect("finish"));
    assert_eq!(
        pieces.concat(),
        tok.decode(ids, true).expect("decode"),
        "{ids:?}"
    );
    pieces
}

#[test]
fn byte_fallback_characters_come_out_whole_and_equal_the_decode() {
    let tok = byte_fallback();
    let (a, b) = (WORD_A, WORD_A + 1);
    // A 4-byte character as byte tokens, then a 3-byte one, then words.
    let mut ids = byte_ids("\u{1f600}");
    ids.extend(byte_ids("\u{20ac}"));
    ids.extend([a, b, a]);
    let pieces = stream(&tok, &ids);
    assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
    assert_eq!(pieces.concat(), "\u{1f600}\u{20ac} ab a");
    // The euro sign alone: sent whole when the stream ends.
    assert_eq!(stream(&tok, &byte_ids("\u{20ac}")).concat(), "\u{20ac}");
    // Word, character, word: the leading-space rule applies to the first token only.
    let mut ids = vec![a];
    ids.extend(byte_ids("\u{20ac}"));
    ids.extend([a, b]);
    assert_eq!(stream(&tok, &ids).concat(), "a\u{20ac} ab");
    // A byte run that turns out invalid is U+FFFD per byte, as the decoder makes it, and
    // nothing valid-looking was sent before it.
    let mut ids = byte_ids("\u{20ac}");
    ids.extend([byte_id(0xE2), a]);
    assert_eq!(stream(&tok, &ids).concat(), "\u{fffd}".repeat(4) + " a");
    // Ending inside a character.
    let ids = [a, byte_id(0xE2), byte_id(0x82)];
    assert_eq!(stream(&tok, &ids).concat(), "a\u{fffd}\u{fffd}");
    // Every sequence of these tokens up to length 4 adds up to its decode.
    let alphabet = [
        a,
        b,
        WORD_A + 2,
        byte_id(0xE2),
        byte_id(0x82),
        byte_id(0xAC),
        byte_id(b'x'),
    ];
    let mut seqs: Vec<Vec<u32>> = vec![vec![]];
    for _ in 0..4 {
        seqs = seqs
            .iter()
            .flat_map(|s| alphabet.iter().map(move |&t| [s.clone(), vec![t]].concat()))
            .collect();
        for s in &seqs {
            stream(&tok, s);
        }
    }
}

/// The server's completion text path (`engine::Completion`, what each sampled token goes
/// through before it is sent): the fault's exact sequence, a 4-byte character as byte tokens
/// followed by a 3-byte one (a panic on a slice inside a character, then U+FFFD per byte),
/// gives whole characters in every piece, and the pieces add up to the decode; the end of
/// sequence token sends what was held; a stop string after a character ends the text there.
#[test]
fn the_servers_text_path_sends_whole_characters_equal_to_the_decode() {
    use nibble_core::models::llama::engine::Completion;
    let tok = byte_fallback();
    let (a, b) = (WORD_A, WORD_A + 1);
    let mut ids = byte_ids("\u{1f600}");
    ids.extend(byte_ids("\u{20ac}"));
    ids.extend([a, b]);
    ids.extend(byte_ids("\u{20ac}"));
    for eos_last in [false, true] {
        let mut c = Completion::default();
        let mut pieces = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let last = !eos_last && i + 1 == ids.len();
            let (piece, stopped) = c.next(&tok, Some(id), last, &[]).expect("next");
            assert!(!stopped && !piece.contains('\u{fffd}'), "{piece:?}");
            pieces.push(piece);
        }
        if eos_last {
            pieces.push(c.next(&tok, None, true, &[]).expect("eos").0);
        }
        assert_eq!(pieces.concat(), tok.decode(&ids, true).expect("decode"));
        assert_eq!(pieces.concat(), "\u{1f600}\u{20ac} ab\u{20ac}");
    }
    // A stop string that begins with a multi-byte character.
    let mut c = Completion::default();
    let stop = vec!["\u{20ac} a".to_string()];
    let mut sent = String::new();
    let mut stopped = false;
    for (i, &id) in ids.iter().enumerate() {
        let (piece, s) = c
            .next(&tok, Some(id), i + 1 == ids.len(), &stop)
            .expect("next");
        sent.push_str(&piece);
        if s {
            stopped = true;
            break;
        }
    }
    assert!(stopped, "the stop string was seen");
    assert_eq!(sent, "\u{1f600}");
}
