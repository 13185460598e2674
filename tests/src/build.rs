//! Building safetensors files byte by byte, including malformed ones, for tests.

use std::path::Path;

/// One tensor for [`build_file`]: name, safetensors dtype string, shape, bytes.
pub type RawEntry = (String, String, Vec<u64>, Vec<u8>);

/// Writes a safetensors file whose header is `header` verbatim followed by `data`.
pub fn write_raw(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write test file");
}

/// The header JSON and data buffer of a well-formed file holding `tensors` in order.
pub fn header_and_data(tensors: &[RawEntry]) -> (String, Vec<u8>) {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        map.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    (serde_json::Value::Object(map).to_string(), data)
}

/// Writes a well-formed file holding `tensors` in order.
pub fn build_file(path: &Path, tensors: &[RawEntry]) {
    let (h, d) = header_and_data(tensors);
    write_raw(path, &h, &d);
}

/// f32 values as a raw entry.
pub fn f32_entry(name: &str, shape: &[u64], values: &[f32]) -> RawEntry {
    (
        name.to_string(),
        "F32".into(),
        shape.to_vec(),
        values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    )
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift), so tests never run on zeros.
pub fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
