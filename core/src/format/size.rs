//! Sizes for people: binary units in and out.

use crate::error::{Error, Result};

/// Human-readable sizes (binary units).
pub fn fmt_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

/// Parses sizes like `512MiB`, `1.5GiB`, `64k`, `4096` (binary multiples).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| Error::Invalid(format!("size '{s}': expected e.g. 512MiB, 1.5GiB, 4096")))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(Error::Invalid(format!("size '{s}': unknown unit '{u}'"))),
    };
    let bytes = v * mult as f64;
    // 2^64 itself rounds to u64::MAX as f64: refuse it too.
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(Error::Invalid(format!("size '{s}' is out of range")));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512MiB").expect("s"), 512 << 20);
        assert_eq!(parse_size("1.5GiB").expect("s"), 3 << 29);
        assert_eq!(parse_size("64k").expect("s"), 65536);
        assert_eq!(parse_size("4096").expect("s"), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
    }
}
