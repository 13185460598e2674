//! What `WanPipeline` does to a prompt before its tokenizer (`prompt_clean`): ftfy's repairs
//! (not reproduced: for text that is not mojibake they change nothing), HTML entities
//! unescaped twice, surrounding whitespace stripped, every whitespace run made one space. Then
//! the umT5 tokenizer (`tokenizer/tokenizer.json`): the pieces plus `</s>`, truncated to the
//! maximum sequence length with `</s>` kept, padded with `<pad>`.

use crate::error::Result;
use crate::models::flux::tokens::T5Tokenizer;

/// Python's `str.isspace` (what `\s` and `strip()` take): Unicode whitespace and the four
/// information separators.
fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The named entities `html.unescape` replaces that prompts use (the HTML 5 list is longer:
/// others stay as written).
const NAMED: [(&str, &str); 24] = [
    ("amp", "&"),
    ("lt", "<"),
    ("gt", ">"),
    ("quot", "\""),
    ("apos", "'"),
    ("nbsp", "\u{a0}"),
    ("copy", "\u{a9}"),
    ("reg", "\u{ae}"),
    ("trade", "\u{2122}"),
    ("hellip", "\u{2026}"),
    ("mdash", "\u{2014}"),
    ("ndash", "\u{2013}"),
    ("lsquo", "\u{2018}"),
    ("rsquo", "\u{2019}"),
    ("ldquo", "\u{201c}"),
    ("rdquo", "\u{201d}"),
    ("laquo", "\u{ab}"),
    ("raquo", "\u{bb}"),
    ("deg", "\u{b0}"),
    ("times", "\u{d7}"),
    ("middot", "\u{b7}"),
    ("eacute", "\u{e9}"),
    ("egrave", "\u{e8}"),
    ("euro", "\u{20ac}"),
];

/// `html.unescape` for numeric references (`&#39;`, `&#x27;`, with or without `;`) and the
/// [`NAMED`] entities (with `;`).
pub fn html_unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 1..];
        let (rep, used) = entity(tail);
        match rep {
            Some(r) => {
                out.push_str(&r);
                rest = &tail[used..];
            }
            None => {
                out.push('&');
                rest = tail;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The replacement of the entity `tail` starts with (after `&`) and the bytes it took.
fn entity(tail: &str) -> (Option<String>, usize) {
    if let Some(num) = tail.strip_prefix('#') {
        let (hex, digits) = match num.strip_prefix(['x', 'X']) {
            Some(h) => (true, h),
            None => (false, num),
        };
        let len = digits
            .chars()
            .take_while(|c| {
                if hex {
                    c.is_ascii_hexdigit()
                } else {
                    c.is_ascii_digit()
                }
            })
            .count();
        if len == 0 {
            return (None, 0);
        }
        let v = u32::from_str_radix(&digits[..len], if hex { 16 } else { 10 }).unwrap_or(u32::MAX);
        // Python maps 0, surrogates and numbers past Unicode to U+FFFD.
        let c = match v {
            0 => '\u{fffd}',
            _ => char::from_u32(v).unwrap_or('\u{fffd}'),
        };
        let mut used = 1 + usize::from(hex) + len;
        if tail[used..].starts_with(';') {
            used += 1;
        }
        return (Some(c.to_string()), used);
    }
    for (name, rep) in NAMED {
        if tail.starts_with(name) && tail[name.len()..].starts_with(';') {
            return (Some(rep.to_string()), name.len() + 1);
        }
    }
    (None, 0)
}

/// `WanPipeline.prompt_clean` without ftfy: unescaped twice, stripped, whitespace runs made one
/// space.
pub fn prompt_clean(text: &str) -> String {
    let t = html_unescape(&html_unescape(text));
    let mut out = String::with_capacity(t.len());
    let mut space = false;
    for c in t.trim_matches(is_space).chars() {
        if is_space(c) {
            space = true;
        } else {
            if space {
                out.push(' ');
                space = false;
            }
            out.push(c);
        }
    }
    out
}

/// The ids the text encoder gets for `text` (cleaned first) and how many of them are the
/// prompt's (the rest is padding): `max_len` ids, `</s>` kept at the end of a truncated prompt.
pub fn prompt_ids(tok: &T5Tokenizer, text: &str, max_len: usize) -> Result<(Vec<u32>, usize)> {
    let (ids, untruncated) = tok.encode(&prompt_clean(text), max_len)?;
    Ok((ids, untruncated.min(max_len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_cleaned_as_the_pipeline_cleans_them() {
        assert_eq!(
            prompt_clean("A red fox&#39;s den  under\n a &amp;amp; tree, \t "),
            "A red fox's den under a & tree,"
        );
        assert_eq!(
            prompt_clean("&#x41;&#66 &lt;b&gt; &bogus; &"),
            "AB <b> &bogus; &"
        );
        assert_eq!(prompt_clean("\u{1c}a\u{a0}\u{2003}b\u{3000}"), "a b");
        assert_eq!(prompt_clean(""), "");
    }
}
