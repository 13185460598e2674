//! The bitsandbytes 4-bit quantizer, reproducing bitsandbytes 0.50's CPU path bit for bit:
//! `quantize_4bit` (absmax per block in f32, `x * (1 / absmax)`, the code by a midpoint
//! search over the sorted code table), and for double quantization the mean offset as
//! `torch.mean` computes it and `quantize_blockwise` of the centred absmax against the signed
//! dynamic map as the native CPU kernel does (through its 65536-bin lookup table).

use crate::error::{Error, Result};
use crate::format::bnb::{
    table_from_bits, FloatDtype, NestedState, QuantStateJson, QuantType, DYNAMIC_MAP_BITS,
    MAX_BLOCKSIZE, MIN_BLOCKSIZE,
};

/// Blocksize bitsandbytes uses for double quantization of absmax.
pub const NESTED_BLOCKSIZE: u64 = 256;

/// How to quantize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizeOptions {
    /// NF4 or FP4.
    pub quant_type: QuantType,
    /// Elements per absmax block (power of two, 32..=4096; transformers always uses 64).
    pub blocksize: u64,
    /// Quantize absmax itself to 8 bits (`bnb_4bit_use_double_quant`).
    pub double_quant: bool,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        QuantizeOptions {
            quant_type: QuantType::Nf4,
            blocksize: 64,
            double_quant: false,
        }
    }
}

/// Quantized absmax: plain f32 or double-quantized.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantizedAbsmax {
    /// One f32 per block.
    F32(Vec<f32>),
    /// 8-bit codes against the dynamic map, one f32 scale per 256 codes.
    Nested {
        /// One u8 per block (`absmax` in the state dict).
        codes: Vec<u8>,
        /// `nested_absmax`.
        nested_absmax: Vec<f32>,
    },
}

/// A quantized weight, ready to be written with the state-dict keys of [`Quantized::tensors`].
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// The quant state JSON (with `nested_offset` when double-quantized).
    pub json: QuantStateJson,
    /// Packed codes, two per byte, first element in the high nibble.
    pub packed: Vec<u8>,
    /// Block scales.
    pub absmax: QuantizedAbsmax,
}

/// Name, dtype and shape of every state-dict entry of a quantized weight with this quant state,
/// in the order [`Quantized::tensors`] produces them.
pub fn state_tensor_specs(
    weight_name: &str,
    json: &QuantStateJson,
) -> Vec<crate::format::writer::TensorSpec> {
    use crate::format::writer::TensorSpec;
    use safetensors::Dtype;
    let spec = |name: String, dtype, shape: Vec<u64>| TensorSpec { name, dtype, shape };
    let nblocks = json.num_blocks();
    let mut v = vec![spec(
        weight_name.to_string(),
        Dtype::U8,
        vec![json.packed_bytes(), 1],
    )];
    match json.num_nested_blocks() {
        Some(nn) => {
            v.push(spec(
                format!("{weight_name}.absmax"),
                Dtype::U8,
                vec![nblocks],
            ));
            v.push(spec(
                format!("{weight_name}.nested_absmax"),
                Dtype::F32,
                vec![nn],
            ));
            v.push(spec(
                format!("{weight_name}.nested_quant_map"),
                Dtype::F32,
                vec![256],
            ));
        }
        None => v.push(spec(
            format!("{weight_name}.absmax"),
            Dtype::F32,
            vec![nblocks],
        )),
    }
    v.push(spec(
        format!("{weight_name}.quant_map"),
        Dtype::F32,
        vec![16],
    ));
    let suffix = json.quant_type.state_key_suffix();
    v.push(spec(
        format!("{weight_name}.{suffix}"),
        Dtype::U8,
        vec![json.to_json_bytes().len() as u64],
    ));
    v
}

/// One tensor to write: name suffix (appended to the weight name), dtype, shape, bytes.
pub type StateTensor = (String, safetensors::Dtype, Vec<u64>, Vec<u8>);

impl Quantized {
    /// The state-dict entries transformers / diffusers write for this weight, named under
    /// `weight_name` (e.g. `model.layers.0.mlp.up_proj.weight`).
    pub fn tensors(&self, weight_name: &str) -> Vec<StateTensor> {
        use safetensors::Dtype;
        let f32b = crate::format::dtype::f32_to_bytes;
        let mut v: Vec<StateTensor> = vec![(
            weight_name.to_string(),
            Dtype::U8,
            vec![self.packed.len() as u64, 1],
            self.packed.clone(),
        )];
        match &self.absmax {
            QuantizedAbsmax::F32(a) => v.push((
                format!("{weight_name}.absmax"),
                Dtype::F32,
                vec![a.len() as u64],
                f32b(a),
            )),
            QuantizedAbsmax::Nested {
                codes,
                nested_absmax,
            } => {
                v.push((
                    format!("{weight_name}.absmax"),
                    Dtype::U8,
                    vec![codes.len() as u64],
                    codes.clone(),
                ));
                v.push((
                    format!("{weight_name}.nested_absmax"),
                    Dtype::F32,
                    vec![nested_absmax.len() as u64],
                    f32b(nested_absmax),
                ));
                let map = table_from_bits(&DYNAMIC_MAP_BITS);
                v.push((
                    format!("{weight_name}.nested_quant_map"),
                    Dtype::F32,
                    vec![256],
                    f32b(&map),
                ));
            }
        }
        let code = self.json.quant_type.code_table();
        v.push((
            format!("{weight_name}.quant_map"),
            Dtype::F32,
            vec![16],
            f32b(&code),
        ));
        let blob = self.json.to_json_bytes();
        v.push((
            format!("{weight_name}.{}", self.json.quant_type.state_key_suffix()),
            Dtype::U8,
            vec![blob.len() as u64],
            blob,
        ));
        v
    }
}

/// Nearest-code search as bitsandbytes' quantizer does it: the code table sorted (stably, so
/// FP4's +0 at index 0 comes before the 0 at index 8), f32 midpoints between neighbours, and the
/// number of midpoints a value exceeds (strict `>`: a tie goes to the lower code). Positive values
/// too small for the first FP4 step therefore become code 8 and negative ones code 0.
#[derive(Debug, Clone)]
struct CodeSearch {
    order: [u8; 16],
    midpoints: [f32; 15],
}

impl CodeSearch {
    fn new(code: &[f32; 16]) -> Self {
        let mut order: [u8; 16] = std::array::from_fn(|i| i as u8);
        order.sort_by(|&a, &b| {
            let (x, y) = (code[a as usize], code[b as usize]);
            x.partial_cmp(&y)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        let midpoints =
            std::array::from_fn(|j| (code[order[j] as usize] + code[order[j + 1] as usize]) / 2.0);
        CodeSearch { order, midpoints }
    }

    fn code(&self, x: f32) -> u8 {
        self.order[self.midpoints.iter().filter(|&&m| x > m).count()]
    }
}

fn check_input(values: &[f32], shape: &[u64], opts: QuantizeOptions) -> Result<()> {
    let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    if n != Some(values.len() as u64) {
        return Err(Error::Invalid(format!(
            "quantize: shape {shape:?} does not match {} values",
            values.len()
        )));
    }
    if values.is_empty() {
        return Err(Error::Invalid(format!(
            "quantize: shape {shape:?} has no elements; a 4-bit weight needs at least one"
        )));
    }
    let bs = opts.blocksize;
    if !bs.is_power_of_two() || !(MIN_BLOCKSIZE..=MAX_BLOCKSIZE).contains(&bs) {
        return Err(Error::Invalid(format!(
            "quantize: blocksize {bs} is not a power of two between {MIN_BLOCKSIZE} and {MAX_BLOCKSIZE}"
        )));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::Invalid(format!(
            "quantize: element {i} is {}, which 4-bit quantization cannot represent",
            values[i]
        )));
    }
    Ok(())
}

fn block_absmax(values: &[f32], bs: usize) -> Vec<f32> {
    values
        .chunks(bs)
        .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect()
}

fn state_json(
    shape: &[u64],
    dtype: FloatDtype,
    opts: QuantizeOptions,
    absmax: &[f32],
) -> QuantStateJson {
    QuantStateJson {
        quant_type: opts.quant_type,
        blocksize: opts.blocksize,
        dtype,
        shape: shape.to_vec(),
        nested: opts.double_quant.then(|| NestedState {
            blocksize: NESTED_BLOCKSIZE,
            dtype: "float32".into(),
            offset: torch_mean_f32(absmax) as f64,
        }),
    }
}

/// The quant state [`quantize_4bit`] would produce, without quantizing (only absmax and its
/// mean are computed): lets a writer lay out a file's header before the data.
pub fn quant_state_for(
    values: &[f32],
    shape: &[u64],
    dtype: FloatDtype,
    opts: QuantizeOptions,
) -> Result<QuantStateJson> {
    check_input(values, shape, opts)?;
    checked_state(state_json(
        shape,
        dtype,
        opts,
        &block_absmax(values, opts.blocksize as usize),
    ))
}

/// A quant state that a reader can load back: the double-quantization offset (a mean of the
/// absmax, which overflows f32 for weights near its limit) must be finite.
fn checked_state(json: QuantStateJson) -> Result<QuantStateJson> {
    match &json.nested {
        Some(n) if !n.offset_f32().is_finite() => Err(Error::Invalid(format!(
            "quantize: the mean of the block absmax is {} (the weights are too large for \
             double quantization in f32); quantize without double quantization",
            n.offset_f32()
        ))),
        _ => Ok(json),
    }
}

/// Quantizes `values` (the weight flattened row-major, already widened to f32 from `dtype`).
pub fn quantize_4bit(
    values: &[f32],
    shape: &[u64],
    dtype: FloatDtype,
    opts: QuantizeOptions,
) -> Result<Quantized> {
    check_input(values, shape, opts)?;
    let bs = opts.blocksize as usize;
    let search = CodeSearch::new(&opts.quant_type.code_table());
    let absmax = block_absmax(values, bs);
    let mut packed = vec![0u8; values.len().div_ceil(2)];
    for (bi, block) in values.chunks(bs).enumerate() {
        // An all-zero block scales to 0 (bitsandbytes encodes it as the code of 0.0).
        let inv = if absmax[bi] == 0.0 {
            0.0
        } else {
            1.0f32 / absmax[bi]
        };
        for (k, &v) in block.iter().enumerate() {
            let i = bi * bs + k;
            let q = search.code(v * inv);
            packed[i / 2] |= if i.is_multiple_of(2) { q << 4 } else { q };
        }
    }
    if values.len() % 2 == 1 {
        // bitsandbytes pads with 0.0 before packing: the spare low nibble holds the code of 0.
        *packed.last_mut().expect("odd length is non-empty") |= search.code(0.0);
    }
    let json = checked_state(state_json(shape, dtype, opts, &absmax))?;
    let absmax = match &json.nested {
        Some(n) => {
            let offset = n.offset_f32();
            let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
            let (codes, nested_absmax) =
                quantize_blockwise_dynamic(&centred, NESTED_BLOCKSIZE as usize);
            QuantizedAbsmax::Nested {
                codes,
                nested_absmax,
            }
        }
        None => QuantizedAbsmax::F32(absmax),
    };
    Ok(Quantized {
        json,
        packed,
        absmax,
    })
}

/// Bins of bitsandbytes' quantization lookup table over [-1, 1].
const LUT_BINS: usize = 65536;

/// The lookup table bitsandbytes 0.50's CPU `quantize_blockwise` builds for a sorted 256-entry
/// map: bin `i` stands for `-1 + 2i / 65535` and holds the first code whose midpoint with its
/// right neighbour is not below that value.
fn quantize_lut(code: &[f32; 256]) -> Vec<u8> {
    let mids: Vec<f32> = (0..255).map(|i| 0.5f32 * (code[i] + code[i + 1])).collect();
    let mut lut = vec![0u8; LUT_BINS];
    let mut ci = 0usize;
    for (i, slot) in lut.iter_mut().enumerate() {
        let val = -1.0f32 + (2.0f32 * i as f32) / (LUT_BINS - 1) as f32;
        while ci < 255 && mids[ci] < val {
            ci += 1;
        }
        *slot = ci as u8;
    }
    lut
}

/// bitsandbytes' native CPU `quantize_blockwise` (0.50) against the signed dynamic map: per block
/// of `blocksize`, absmax = max |x|, `x * (1 / absmax)` clamped to [-1, 1], then the lookup table
/// at bin `trunc(((v + 1) * 0.5) * 65535 + 0.5)` (so a value within half a bin of a midpoint can
/// take the farther code, exactly as bitsandbytes does). An all-zero block gives codes 0.
pub fn quantize_blockwise_dynamic(x: &[f32], blocksize: usize) -> (Vec<u8>, Vec<f32>) {
    use std::sync::OnceLock;
    static LUT: OnceLock<Vec<u8>> = OnceLock::new();
    let lut = LUT.get_or_init(|| quantize_lut(&table_from_bits(&DYNAMIC_MAP_BITS)));
    let mut out = Vec::with_capacity(x.len());
    let mut absmaxes = Vec::with_capacity(x.len().div_ceil(blocksize));
    for block in x.chunks(blocksize) {
        let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmaxes.push(absmax);
        if absmax == 0.0 {
            out.extend(std::iter::repeat_n(0u8, block.len()));
            continue;
        }
        let inv = 1.0f32 / absmax;
        for &v in block {
            let normed = (v * inv).clamp(-1.0, 1.0);
            let bin = ((normed + 1.0) * 0.5 * (LUT_BINS - 1) as f32 + 0.5) as usize;
            out.push(lut[bin.min(LUT_BINS - 1)]);
        }
    }
    (out, absmaxes)
}

/// `torch.mean` of an f32 vector as torch 2.x computes it on one CPU thread: the cascade sum of
/// `SumKernel.cpp` (8-lane vectors, 4-way ILP, 4 cascade levels, f32 accumulators), then a
/// division by n. Reductions of more than 32768 elements are split across threads by torch and
/// may differ in the last bit from this single-threaded order.
pub fn torch_mean_f32(x: &[f32]) -> f32 {
    torch_sum_f32(x) / x.len() as f32
}

/// The single-threaded `torch.sum` of a contiguous f32 vector (see [`torch_mean_f32`]).
pub fn torch_sum_f32(x: &[f32]) -> f32 {
    const LANES: usize = 8;
    let n = x.len();
    if n >= LANES {
        let vec_size = n / LANES;
        let vacc = row_sum::<LANES>(
            |i| {
                let mut a = [0f32; LANES];
                a.copy_from_slice(&x[i * LANES..(i + 1) * LANES]);
                a
            },
            vec_size,
        );
        let mut acc = 0f32;
        for v in &x[vec_size * LANES..] {
            acc += v;
        }
        for v in vacc {
            acc += v;
        }
        0.0 + acc
    } else {
        0.0 + row_sum::<1>(|i| [x[i]], n)[0]
    }
}

fn add<const L: usize>(a: &mut [f32; L], b: [f32; L]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

fn ceil_log2(x: usize) -> usize {
    if x <= 2 {
        1
    } else {
        (usize::BITS - (x - 1).leading_zeros()) as usize
    }
}

fn row_sum<const L: usize>(load: impl Fn(usize) -> [f32; L], size: usize) -> [f32; L] {
    const ILP: usize = 4;
    let size_ilp = size / ILP;
    let mut partial = multi_row_sum::<L>(|i, k| load(i * ILP + k), size_ilp);
    for i in size_ilp * ILP..size {
        add(&mut partial[0], load(i));
    }
    let mut out = partial[0];
    for p in &partial[1..] {
        add(&mut out, *p);
    }
    out
}

// Index loops mirror SumKernel.cpp line for line, which is what makes the order checkable.
#[allow(clippy::needless_range_loop)]
fn multi_row_sum<const L: usize>(
    load: impl Fn(usize, usize) -> [f32; L],
    size: usize,
) -> [[f32; L]; 4] {
    const LEVELS: usize = 4;
    const ROWS: usize = 4;
    let level_power = 4.max(ceil_log2(size) / LEVELS);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0f32; L]; ROWS]; LEVELS];
    let mut i = 0;
    while i + level_step <= size {
        for _ in 0..level_step {
            for k in 0..ROWS {
                add(&mut acc[0][k], load(i, k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            for k in 0..ROWS {
                let prev = acc[j - 1][k];
                add(&mut acc[j][k], prev);
                acc[j - 1][k] = [0f32; L];
            }
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        for k in 0..ROWS {
            add(&mut acc[0][k], load(i, k));
        }
        i += 1;
    }
    let mut out = acc[0];
    for level in &acc[1..] {
        for k in 0..ROWS {
            add(&mut out[k], level[k]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_sum_matches_exact_sum_on_exact_inputs() {
        // Integers are summed exactly in f32, whatever the order.
        for n in [0usize, 1, 5, 8, 31, 64, 1041, 5000, 70_000] {
            let x: Vec<f32> = (0..n).map(|i| (i % 97) as f32).collect();
            let exact: f64 = x.iter().map(|&v| v as f64).sum();
            assert_eq!(torch_sum_f32(&x) as f64, exact, "n={n}");
        }
    }

    #[test]
    fn specs_describe_the_written_tensors() {
        let w: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        for dq in [false, true] {
            for qt in [QuantType::Nf4, QuantType::Fp4] {
                let opts = QuantizeOptions {
                    quant_type: qt,
                    blocksize: 128,
                    double_quant: dq,
                };
                let q = quantize_4bit(&w, &[10, 100], FloatDtype::F16, opts).expect("q");
                let specs = state_tensor_specs("x.weight", &q.json);
                let got: Vec<_> = q
                    .tensors("x.weight")
                    .into_iter()
                    .map(|(n, d, s, _)| (n, d, s))
                    .collect();
                let want: Vec<_> = specs
                    .into_iter()
                    .map(|s| (s.name, s.dtype, s.shape))
                    .collect();
                assert_eq!(got, want);
                let pre = quant_state_for(&w, &[10, 100], FloatDtype::F16, opts).expect("json");
                assert_eq!(pre, q.json);
            }
        }
    }

    #[test]
    fn all_zero_block_encodes_as_zero_code() {
        let mut w = vec![0f32; 64];
        w.extend((0..64).map(|i| i as f32 - 31.5));
        let q = quantize_4bit(&w, &[128], FloatDtype::F32, QuantizeOptions::default()).expect("q");
        assert!(
            q.packed[..32].iter().all(|&b| b == 0x77),
            "NF4 code 7 is 0.0"
        );
        let opts = QuantizeOptions {
            quant_type: QuantType::Fp4,
            ..Default::default()
        };
        let q = quantize_4bit(&w, &[128], FloatDtype::F32, opts).expect("q");
        assert!(q.packed[..32].iter().all(|&b| b == 0), "FP4 code 0 is 0.0");
    }

    #[test]
    fn rejects_bad_input() {
        let o = QuantizeOptions::default();
        assert!(quantize_4bit(&[1.0; 6], &[2, 2], FloatDtype::F32, o).is_err());
        assert!(quantize_4bit(&[f32::NAN; 4], &[4], FloatDtype::F32, o).is_err());
        let bad_bs = QuantizeOptions { blocksize: 48, ..o };
        assert!(quantize_4bit(&[1.0; 4], &[4], FloatDtype::F32, bad_bs).is_err());
    }
}
