//! GGUF v2/v3 files (llama.cpp's format): the key/value metadata, the tensor table, and
//! dequantization of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K to f32, in the same f32
//! arithmetic as gguf-py's reference (`gguf.quants.dequantize`). Every length and offset is
//! checked against the file; a malformed file is an error naming the key, tensor and offset.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// An array of numbers as stored: element type (GGUF's code) and little-endian bytes, so that
    /// an array takes the memory its bytes take in the file (not 32 bytes per element).
    Numbers {
        /// GGUF value type of the elements (0..=7, 10..=12).
        ty: u32,
        /// The elements' bytes.
        raw: Vec<u8>,
    },
    /// An array of strings.
    Strings(Vec<String>),
    /// An array of arrays.
    Array(Vec<Value>),
}

/// Bytes per element of a GGUF numeric value type.
fn number_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

impl Value {
    /// As an unsigned integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U64(v) => Some(*v),
            Value::I64(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }
    /// As a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F64(v) => Some(*v),
            Value::U64(v) => Some(*v as f64),
            Value::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As an array of strings.
    pub fn as_strs(&self) -> Option<&[String]> {
        match self {
            Value::Strings(a) => Some(a),
            _ => None,
        }
    }

    /// As an array of unsigned integers (each element of a numeric array that is one).
    pub fn as_u64s(&self) -> Option<Vec<u64>> {
        let Value::Numbers { ty, raw } = self else {
            return None;
        };
        let size = number_size(*ty)? as usize;
        raw.chunks_exact(size)
            .map(|c| {
                let mut a = [0u8; 8];
                a[..size].copy_from_slice(c);
                let v = u64::from_le_bytes(a);
                match ty {
                    0 | 2 | 4 | 7 | 10 => Some(v),
                    // Signed: negative values are not unsigned integers.
                    1 => Some(c[0] as i8 as i64)
                        .filter(|x| *x >= 0)
                        .map(|x| x as u64),
                    3 => Some(i16::from_le_bytes([c[0], c[1]]) as i64)
                        .filter(|x| *x >= 0)
                        .map(|x| x as u64),
                    5 => Some(i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                        .filter(|x| *x >= 0)
                        .map(|x| x as u64),
                    11 => Some(v as i64).filter(|x| *x >= 0).map(|x| x as u64),
                    _ => None,
                }
            })
            .collect()
    }
    /// As a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

/// ggml tensor types nibble reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// float32.
    F32,
    /// float16.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 values: f16 scale, 32 x i8.
    Q8_0,
    /// 32 values: f16 scale, 32 x 4-bit (offset 8).
    Q4_0,
    /// 32 values: f16 scale and min, 32 x 4-bit.
    Q4_1,
    /// 256 values: f16 d and dmin, 8 x 6-bit scales and mins, 256 x 4-bit.
    Q4K,
    /// 256 values: 4 + 2 bit quants, 16 x i8 scales, f16 d.
    Q6K,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// (values per block, bytes per block).
    pub fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q6K => (256, 210),
        }
    }

    /// Name as llama.cpp writes it.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q6K => "Q6_K",
        }
    }
}

/// One tensor of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensor {
    /// Name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// ggml dims, innermost first (`ne[0]` is the row length).
    pub dims: Vec<u64>,
    /// Type.
    pub ty: GgmlType,
    /// Absolute offset of its data in the file.
    pub offset: u64,
    /// Bytes of its data.
    pub len: u64,
}

impl GgufTensor {
    /// Number of values.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
    /// The PyTorch shape (dims reversed).
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// An open GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    path: String,
    file: std::fs::File,
    /// Format version (2 or 3).
    pub version: u32,
    /// The metadata.
    pub meta: BTreeMap<String, Value>,
    /// The tensors, in file order.
    pub tensors: Vec<GgufTensor>,
}

struct Reader<R: Read> {
    r: R,
    pos: u64,
    len: u64,
    path: String,
}

impl<R: Read> Reader<R> {
    fn bad(&self, what: &str) -> Error {
        Error::Model {
            file: self.path.clone(),
            msg: format!("{what} at byte {}", self.pos),
        }
    }
    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if self.pos.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(self.bad(&format!(
                "{what} of {n} bytes runs past the end of the file"
            )));
        }
        let mut b = vec![0u8; n as usize];
        self.r
            .read_exact(&mut b)
            .map_err(|e| Error::io(&self.path, e))?;
        self.pos += n;
        Ok(b)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.bytes(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        if n > 1 << 30 {
            return Err(self.bad(&format!("{what}: string length {n}")));
        }
        let b = self.bytes(n, what)?;
        String::from_utf8(b).map_err(|_| self.bad(&format!("{what}: not UTF-8")))
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let w = |b: Vec<u8>| -> [u8; 8] {
            let mut a = [0u8; 8];
            a[..b.len()].copy_from_slice(&b);
            a
        };
        Ok(match ty {
            0 => Value::U64(self.bytes(1, key)?[0] as u64),
            1 => Value::I64(self.bytes(1, key)?[0] as i8 as i64),
            2 => {
                let b = self.bytes(2, key)?;
                Value::U64(u16::from_le_bytes([b[0], b[1]]) as u64)
            }
            3 => {
                let b = self.bytes(2, key)?;
                Value::I64(i16::from_le_bytes([b[0], b[1]]) as i64)
            }
            4 => Value::U64(self.u32(key)? as u64),
            5 => Value::I64(self.u32(key)? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32(key)?) as f64),
            7 => Value::Bool(self.bytes(1, key)?[0] != 0),
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(self.bad(&format!("{key}: arrays nested too deep")));
                }
                let et = self.u32(key)?;
                let n = self.u64(key)?;
                if n > self.len {
                    return Err(self.bad(&format!("{key}: array of {n} values")));
                }
                if let Some(size) = number_size(et) {
                    let bytes = n
                        .checked_mul(size)
                        .ok_or_else(|| self.bad(&format!("{key}: array of {n} values")))?;
                    Value::Numbers {
                        ty: et,
                        raw: self.bytes(bytes, key)?,
                    }
                } else if et == 8 {
                    // Each string takes at least its 8-byte length in the file.
                    let mut v = Vec::with_capacity(n.min(self.len / 8) as usize);
                    for _ in 0..n {
                        v.push(self.string(key)?);
                    }
                    Value::Strings(v)
                } else {
                    let mut v = Vec::with_capacity(n.min(self.len / 16) as usize);
                    for _ in 0..n {
                        v.push(self.value(et, key, depth + 1)?);
                    }
                    Value::Array(v)
                }
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_le_bytes(w(self.bytes(8, key)?))),
            other => return Err(self.bad(&format!("{key}: unknown value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Opens and validates a GGUF file (header, metadata, tensor table; data is read later).
    pub fn open(path: &Path) -> Result<Self> {
        let disp = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| Error::io(&disp, e))?;
        let len = file.metadata().map_err(|e| Error::io(&disp, e))?.len();
        let mut r = Reader {
            r: std::io::BufReader::new(file.try_clone().map_err(|e| Error::io(&disp, e))?),
            pos: 0,
            len,
            path: disp.clone(),
        };
        if r.bytes(4, "magic")? != b"GGUF" {
            return Err(Error::Model {
                file: disp,
                msg: "not a GGUF file (no 'GGUF' magic)".into(),
            });
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(r.bad(&format!("GGUF version {version} (2 and 3 are supported)")));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        if n_tensors > len / 16 || n_kv > len / 16 {
            return Err(r.bad(&format!(
                "{n_tensors} tensors / {n_kv} keys in a {len}-byte file"
            )));
        }
        let mut meta = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32(&key)?;
            let v = r.value(ty, &key, 0)?;
            meta.insert(key, v);
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let nd = r.u32(&name)?;
            if nd == 0 || nd > 4 {
                return Err(r.bad(&format!("tensor '{name}': {nd} dimensions")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(r.u64(&name)?);
            }
            let ty_id = r.u32(&name)?;
            let rel = r.u64(&name)?;
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| Error::Model {
                file: disp.clone(),
                msg: format!(
                    "tensor '{name}': ggml type {ty_id} is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)"
                ),
            })?;
            infos.push((name, dims, ty, rel));
        }
        // llama.cpp refuses an alignment that is not a power of two (tensor offsets would not
        // be where the file's writer put them).
        let align = match meta.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(Error::Model {
                        file: disp.clone(),
                        msg: format!("general.alignment {v:?} is not a power of two"),
                    })
                }
            },
        };
        let data_start = r.pos.div_ceil(align) * align;
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, dims, ty, rel) in infos {
            let numel = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| Error::Model {
                    file: disp.clone(),
                    msg: format!("tensor '{name}': shape {dims:?} overflows"),
                })?;
            let (bv, bb) = ty.block();
            if numel % bv != 0 || dims[0] % bv != 0 {
                return Err(Error::Model {
                    file: disp.clone(),
                    msg: format!(
                        "tensor '{name}': rows of {} values are not whole {} blocks",
                        dims[0],
                        ty.name()
                    ),
                });
            }
            let bytes = (numel / bv).checked_mul(bb).ok_or_else(|| Error::Model {
                file: disp.clone(),
                msg: format!("tensor '{name}': shape {dims:?} overflows"),
            })?;
            let offset = data_start.saturating_add(rel);
            if offset.checked_add(bytes).is_none_or(|e| e > len) {
                return Err(Error::OffsetOutOfRange {
                    file: disp.clone(),
                    tensor: name,
                    offset,
                    end: offset.saturating_add(bytes),
                    file_len: len,
                });
            }
            tensors.push(GgufTensor {
                name,
                dims,
                ty,
                offset,
                len: bytes,
            });
        }
        Ok(GgufFile {
            path: disp,
            file,
            version,
            meta,
            tensors,
        })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor.
    pub fn read(&self, t: &GgufTensor) -> Result<Vec<u8>> {
        let mut b = vec![0u8; t.len as usize];
        let what = || format!("{} (tensor '{}')", self.path, t.name);
        let got = crate::format::positional::pread_full(&self.file, t.offset, &mut b)
            .map_err(|e| Error::io(what(), e))?;
        if got != b.len() {
            return Err(Error::ShortRead {
                file: self.path.clone(),
                tensor: t.name.clone(),
                offset: t.offset,
                wanted: t.len,
                got: got as u64,
            });
        }
        Ok(b)
    }

    /// A tensor dequantized to f32, in row-major order of its PyTorch shape.
    pub fn read_f32(&self, t: &GgufTensor) -> Result<Vec<f32>> {
        let raw = self.read(t)?;
        Ok(dequantize(t.ty, &raw, t.numel() as usize))
    }
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Dequantizes `n` values of type `ty` (as gguf-py does: f32 products, no fused multiply-add).
pub fn dequantize(ty: GgmlType, raw: &[u8], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    let (bv, bb) = ty.block();
    let blocks = raw.chunks_exact(bb as usize).take(n / bv as usize);
    match ty {
        GgmlType::F32 => out.extend(
            raw.chunks_exact(4)
                .take(n)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        GgmlType::F16 => out.extend(raw.chunks_exact(2).take(n).map(f16)),
        GgmlType::Bf16 => out.extend(
            raw.chunks_exact(2)
                .take(n)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        GgmlType::Q8_0 => {
            for b in blocks {
                let d = f16(&b[0..2]);
                out.extend(b[2..34].iter().map(|&q| d * (q as i8) as f32));
            }
        }
        GgmlType::Q4_0 => {
            for b in blocks {
                let d = f16(&b[0..2]);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| d * ((q & 15) as i32 - 8) as f32));
                out.extend(qs.iter().map(|&q| d * ((q >> 4) as i32 - 8) as f32));
            }
        }
        GgmlType::Q4_1 => {
            for b in blocks {
                let (d, m) = (f16(&b[0..2]), f16(&b[2..4]));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| d * (q & 15) as f32 + m));
                out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
            }
        }
        GgmlType::Q4K => {
            for b in blocks {
                let (d, dmin) = (f16(&b[0..2]), f16(&b[2..4]));
                let s = &b[4..16];
                let qs = &b[16..144];
                let mut sc = [0u8; 8];
                let mut mn = [0u8; 8];
                for i in 0..4 {
                    sc[i] = s[i] & 63;
                    mn[i] = s[4 + i] & 63;
                    sc[4 + i] = (s[8 + i] & 15) | ((s[i] >> 2) & 0x30);
                    mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
                }
                for j in 0..8 {
                    let (dd, dm) = (d * sc[j] as f32, dmin * mn[j] as f32);
                    let bytes = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
                    let shift = if j % 2 == 0 { 0 } else { 4 };
                    out.extend(bytes.iter().map(|&q| dd * ((q >> shift) & 15) as f32 - dm));
                }
            }
        }
        GgmlType::Q6K => {
            for b in blocks {
                let (ql, qh) = (&b[0..128], &b[128..192]);
                let scales = &b[192..208];
                let d = f16(&b[208..210]);
                for e in 0..256usize {
                    let (h, r) = (e / 128, e % 128);
                    let lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 15;
                    let hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
                    let q = (lo | (hi << 4)) as i32 - 32;
                    out.push((d * scales[e / 16] as i8 as f32) * q as f32);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_is_scale_times_code_plus_min_low_nibbles_first() {
        let mut b = Vec::new();
        b.extend(half::f16::from_f32(0.5).to_le_bytes());
        b.extend(half::f16::from_f32(-1.0).to_le_bytes());
        b.extend((0..16u8).map(|i| (15 - i) << 4 | i));
        let v = dequantize(GgmlType::Q4_1, &b, 32);
        for i in 0..16 {
            assert_eq!(v[i], 0.5 * i as f32 - 1.0);
            assert_eq!(v[16 + i], 0.5 * (15 - i) as f32 - 1.0);
        }
    }

    #[test]
    fn q8_0_and_q4_0() {
        let mut b = Vec::new();
        b.extend(half::f16::from_f32(0.25).to_le_bytes());
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(GgmlType::Q8_0, &b, 32);
        assert_eq!(v[0], -4.0);
        assert_eq!(v[31], 3.75);
        let mut b = Vec::new();
        b.extend(half::f16::from_f32(2.0).to_le_bytes());
        b.extend([0x9fu8; 16]);
        let v = dequantize(GgmlType::Q4_0, &b, 32);
        assert_eq!((v[0], v[16]), (14.0, 2.0));
    }

    #[test]
    fn q4_k_scales_and_mins_unpack_as_llama_cpp_does() {
        // d = 1, dmin = 0.5; 12 scale bytes chosen so that sub-blocks 4..7 take their high bits
        // from bytes 0..7 (llama.cpp's get_scale_min_k4): sc[j] = j + 1 for j < 4 plus 0x40 in
        // the stored byte, m[j] = j; for j >= 4 the low 4 bits come from byte j + 4.
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = (j as u8 + 1) | 0x40; // sc low 6 bits, bit 6 feeds sc[j + 4] bit 4
            s[4 + j] = j as u8 | 0x80; // m low 6 bits, bit 7 feeds m[j + 4] bit 5
            s[8 + j] = (j as u8 + 2) | ((j as u8 + 3) << 4);
        }
        let mut b = Vec::new();
        b.extend(half::f16::from_f32(1.0).to_le_bytes());
        b.extend(half::f16::from_f32(0.5).to_le_bytes());
        b.extend(s);
        // Bytes 32g..32g+32: low nibble 1 (sub-block 2g), high nibble 2 (sub-block 2g + 1).
        b.extend([0x21u8; 128]);
        let v = dequantize(GgmlType::Q4K, &b, 256);
        for j in 0..8usize {
            let (sc, m) = if j < 4 {
                (j as f32 + 1.0, j as f32)
            } else {
                let i = j - 4;
                ((i + 2) as f32 + 16.0, (i + 3) as f32 + 32.0)
            };
            let q = if j % 2 == 0 { 1.0 } else { 2.0 };
            for e in 0..32 {
                assert_eq!(v[j * 32 + e], sc * q - 0.5 * m, "sub-block {j}");
            }
        }
    }

    #[test]
    fn q6_k_layout() {
        // All 4-bit parts 1, all 2-bit parts 2: q = 1 | 2 << 4 = 33, minus 32 = 1; scale i at
        // sub-block i; d = 0.5.
        let mut b = vec![0x11u8; 128];
        b.extend([0xaau8; 64]);
        b.extend((0..16).map(|i| i as u8));
        b.extend(half::f16::from_f32(0.5).to_le_bytes());
        let v = dequantize(GgmlType::Q6K, &b, 256);
        for (e, x) in v.iter().enumerate() {
            assert_eq!(*x, 0.5 * (e / 16) as f32, "element {e}");
        }
    }
}
