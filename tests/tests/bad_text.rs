//! Chat templates are code from the model folder (fault class 16): they run on a budget of
//! instructions and of output, so that a template that loops without end or prints without
//! end is an error in bounded time and memory, while real templates render as before.

use nibble_core::models::text::{Message, TextTokenizer};
use nibble_tests::fixture;

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
