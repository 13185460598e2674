//! Entry points shared by the `cargo fuzz` targets (`fuzz/`) and the deterministic smoke test:
//! arbitrary bytes go in, and the only acceptable outcomes are `Ok` or an error value.

use crate::format::bnb::{QuantState, QuantStateJson, QuantStateParts, RawTensor};
use crate::format::dtype::Dtype;
use crate::format::safetensors::SafetensorsHeader;

/// Largest element count a fuzz input may make us dequantize (keeps memory bounded).
const MAX_FUZZ_ELEMENTS: u64 = 1 << 20;

/// Treats `data` as a whole safetensors file: header length, header JSON, validation.
pub fn safetensors_file(data: &[u8]) {
    let len = data.len() as u64;
    if let Ok(header_len) = SafetensorsHeader::parse_header_len("fuzz", data, len) {
        let header = &data[8..8 + header_len as usize];
        if let Ok(h) = SafetensorsHeader::parse("fuzz", header, len) {
            for t in &h.tensors {
                assert!(t.end() <= len, "validated range past the end");
            }
        }
    }
}

fn raw(dtype: Dtype, bytes: &[u8]) -> RawTensor<'_> {
    let numel = if dtype == Dtype::U8 {
        bytes.len() as u64
    } else {
        bytes.len() as u64 / 4
    };
    RawTensor {
        dtype,
        numel,
        bytes,
    }
}

/// Treats `data` as a quant-state JSON blob followed (after a NUL byte) by component bytes:
/// absmax, then optionally nested absmax; parses, validates and, when valid, dequantizes.
pub fn quant_state(data: &[u8]) {
    let (json, rest) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(parsed) = QuantStateJson::parse(json) else {
        return;
    };
    let code = parsed.quant_type.code_table();
    let code_bytes: Vec<u8> = code.iter().flat_map(|v| v.to_le_bytes()).collect();
    let map_bytes: Vec<u8> =
        crate::format::bnb::table_from_bits(&crate::format::bnb::DYNAMIC_MAP_BITS)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
    let nested = parsed.nested.is_some();
    let nblocks = parsed.num_blocks() as usize;
    let absmax_len = if nested {
        nblocks
    } else {
        nblocks.saturating_mul(4)
    };
    let (absmax, rest) = rest.split_at(absmax_len.min(rest.len()));
    let nn = parsed.num_nested_blocks().unwrap_or(0) as usize;
    let (nested_absmax, packed) = rest.split_at(nn.saturating_mul(4).min(rest.len()));
    // Copies so that the slices are 4-byte sized as a file's would be.
    let absmax_v = absmax.to_vec();
    let nested_v = nested_absmax.to_vec();
    let parts = QuantStateParts {
        key_quant_type: parsed.quant_type,
        json,
        absmax: raw(if nested { Dtype::U8 } else { Dtype::F32 }, &absmax_v),
        quant_map: raw(Dtype::F32, &code_bytes),
        nested_absmax: nested.then(|| raw(Dtype::F32, &nested_v)),
        nested_quant_map: nested.then(|| raw(Dtype::F32, &map_bytes)),
    };
    let Ok(state) = QuantState::from_parts("fuzz", "w", &parts) else {
        return;
    };
    if state.json.numel() > MAX_FUZZ_ELEMENTS {
        return;
    }
    let mut a = vec![0f32; state.numel()];
    let mut b = vec![0f32; state.numel()];
    let ra = state.dequantize_ref(packed, &mut a);
    let rb = state.dequantize(packed, &mut b);
    assert_eq!(ra.is_ok(), rb.is_ok());
    if ra.is_ok() {
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "fast != ref"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    /// Deterministic mutation smoke test (the real fuzzing runs with `cargo fuzz`, see docs/testing.md):
    /// flips, truncations and splices of valid inputs must never panic.
    #[test]
    fn mutated_inputs_never_panic() {
        let header = br#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"U8","shape":[5],"data_offsets":[24,29]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[7u8; 29]);
        let mut qs = br#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [9, 13], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.25}"#.to_vec();
        qs.push(0);
        qs.extend_from_slice(&[3u8, 200]);
        qs.extend_from_slice(&1.5f32.to_le_bytes());
        qs.extend((0..59).map(|i| i as u8));
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for seed in [&file[..], &qs[..]] {
            safetensors_file(seed);
            quant_state(seed);
            for _ in 0..5000 {
                let mut m = seed.to_vec();
                for _ in 0..1 + xorshift(&mut s) % 4 {
                    let i = (xorshift(&mut s) as usize) % m.len().max(1);
                    match xorshift(&mut s) % 4 {
                        0 if !m.is_empty() => m[i] ^= 1 << (xorshift(&mut s) % 8),
                        1 => m.truncate(i),
                        2 if !m.is_empty() => {
                            m[i] = b"0123456789-e.,[]{}\":"[(xorshift(&mut s) % 20) as usize]
                        }
                        _ => m.insert(i.min(m.len()), xorshift(&mut s) as u8),
                    }
                }
                safetensors_file(&m);
                quant_state(&m);
            }
        }
    }
}
