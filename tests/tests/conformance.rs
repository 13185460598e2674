//! Cross-backend conformance, the way ggml's test-backend-ops does it: one table of cases with
//! fixed seeds (odd shapes, partial quant blocks, more invocations than one workgroup), every case
//! run on every backend present at run time and compared with `cpu_ref` under a named tolerance.
//! A backend that is absent is reported as absent, never as passed.
//!
//! `cargo test -p nibble-tests --test conformance -- --nocapture` prints the table.

use nibble_core::backend::cpu_ref::{self, Q4Ref};
use nibble_core::format::bnb::{FloatDtype, QuantState, QuantType};
use nibble_core::format::quantize::{quantize_4bit, QuantizeOptions, QuantizedAbsmax};
use nibble_core::graph::{HostTensor, OpKind, RopeMode};
use nibble_core::io::model::ModelIndex;
use nibble_tests::build::random_values;
use nibble_tests::*;

/// How close a backend must come to `cpu_ref`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Tolerance {
    /// Bit for bit (-0.0 == +0.0).
    Exact,
    /// `max |got - want| <= r * max |want|` (f32 arithmetic against f64 reference).
    RelToMax(f64),
    /// `max |got - want| <= a` (transcendentals of large arguments).
    Abs(f64),
}

/// The tolerance of each op. Exhaustive: a new op does not compile until it is given one and a
/// case below.
fn tolerance(op: &OpKind) -> Tolerance {
    match op {
        OpKind::Dequant4 => Tolerance::Exact,
        OpKind::Embedding
        | OpKind::Concat { .. }
        | OpKind::Slice { .. }
        | OpKind::Permute { .. }
        | OpKind::Reshape { .. } => Tolerance::Exact,
        OpKind::LinearQ4 { .. } | OpKind::Linear { .. } | OpKind::MatMul { .. } => {
            Tolerance::RelToMax(2e-5)
        }
        OpKind::Add | OpKind::Mul | OpKind::Scale { .. } | OpKind::AdaLnModulate => {
            Tolerance::RelToMax(1e-6)
        }
        OpKind::RmsNorm { .. } | OpKind::LayerNorm { .. } | OpKind::Softmax => {
            Tolerance::RelToMax(1e-5)
        }
        OpKind::Silu | OpKind::Gelu | OpKind::GeluTanh | OpKind::QuickGelu => {
            Tolerance::RelToMax(1e-5)
        }
        OpKind::Rope { .. } | OpKind::Attention { .. } => Tolerance::RelToMax(1e-5),
        OpKind::CacheWrite => Tolerance::Exact,
        OpKind::TimestepEmbedding { .. } => Tolerance::Abs(2e-4),
        // Sums of C*k*k f32 products against the f64 reference.
        OpKind::Conv2d { .. } => Tolerance::RelToMax(2e-5),
        OpKind::GroupNorm { .. } => Tolerance::RelToMax(1e-5),
        OpKind::Upsample2x => Tolerance::Exact,
    }
}

/// CUDA runs the 4-bit linear on more than 8 rows as bf16 x bf16 GEMM with f32 accumulation
/// (cuBLAS): its error is bf16's, not f32's.
fn cuda_tolerance(op: &OpKind, inputs: &[&HostTensor]) -> Tolerance {
    match op {
        OpKind::LinearQ4 { .. } if inputs[0].info.shape[0] > nibble_cuda::GEMV_MAX_ROWS => {
            Tolerance::RelToMax(2e-2)
        }
        _ => tolerance(op),
    }
}

struct Case {
    label: String,
    op: OpKind,
    inputs: Vec<HostTensor>,
    q4: Option<(QuantState, Vec<u8>)>,
}

fn t(shape: &[usize], seed: u64) -> HostTensor {
    let n = shape.iter().product();
    HostTensor::f32(shape, random_values(n, seed)).expect("tensor")
}

fn q4_weight(
    rows: usize,
    cols: usize,
    bs: u64,
    qt: QuantType,
    dq: bool,
    seed: u64,
) -> (QuantState, Vec<u8>) {
    let w = random_values(rows * cols, seed);
    let opts = QuantizeOptions {
        quant_type: qt,
        blocksize: bs,
        double_quant: dq,
    };
    let q =
        quantize_4bit(&w, &[rows as u64, cols as u64], FloatDtype::F32, opts).expect("quantize");
    let absmax = match &q.absmax {
        QuantizedAbsmax::F32(a) => a.clone(),
        QuantizedAbsmax::Nested { .. } => {
            // Resolve through the on-disk form, as a loaded model would.
            let d = tempfile::tempdir().expect("tmp");
            let p = d.path().join("w.safetensors");
            nibble_core::format::writer::write_safetensors(
                &p,
                &q.tensors("w"),
                &Default::default(),
            )
            .expect("write");
            let m = ModelIndex::open(&p).expect("open");
            let k = &m.q4_weights().map(<[_]>::to_vec).expect("find")[0];
            return (m.quant_state(k).expect("load"), q.packed.clone());
        }
    };
    (
        QuantState {
            json: q.json.clone(),
            code: qt.code_table(),
            absmax,
        },
        q.packed,
    )
}

/// The cases of one op. Exhaustive over `OpKind`.
fn cases(op: &OpKind) -> Vec<Case> {
    let c = |label: &str, inputs: Vec<HostTensor>| Case {
        label: label.into(),
        op: op.clone(),
        inputs,
        q4: None,
    };
    let cq = |label: &str, inputs: Vec<HostTensor>, q: (QuantState, Vec<u8>)| Case {
        label: label.into(),
        op: op.clone(),
        inputs,
        q4: Some(q),
    };
    match op {
        OpKind::Dequant4 => vec![
            cq(
                "nf4 37x53 bs64 dq",
                vec![],
                q4_weight(37, 53, 64, QuantType::Nf4, true, 1),
            ),
            cq(
                "fp4 29x71 bs32",
                vec![],
                q4_weight(29, 71, 32, QuantType::Fp4, false, 2),
            ),
            cq(
                "nf4 300x257 bs256",
                vec![],
                q4_weight(300, 257, 256, QuantType::Nf4, false, 3),
            ),
        ],
        OpKind::LinearQ4 { bias } => {
            // The GEMV path (up to 8 rows) and the tiled path (more); odd sizes, partial blocks.
            let mut v = vec![
                cq(
                    "1x53 by 37x53 nf4 dq (gemv)",
                    vec![t(&[1, 53], 4)],
                    q4_weight(37, 53, 64, QuantType::Nf4, true, 5),
                ),
                cq(
                    "5x333 by 100x333 fp4 (gemv)",
                    vec![t(&[5, 333], 6)],
                    q4_weight(100, 333, 128, QuantType::Fp4, false, 7),
                ),
                cq(
                    "37x333 by 100x333 nf4 dq (tiled)",
                    vec![t(&[37, 333], 39)],
                    q4_weight(100, 333, 64, QuantType::Nf4, true, 40),
                ),
                // Whole blocks per row: the CPU backend's SIMD paths, split across threads.
                cq(
                    "3x512 by 200x512 nf4 dq bs64 (rows of whole blocks, gemv)",
                    vec![t(&[3, 512], 58)],
                    q4_weight(200, 512, 64, QuantType::Nf4, true, 59),
                ),
                cq(
                    "29x256 by 77x256 fp4 bs32 (rows of whole blocks, tiles)",
                    vec![t(&[29, 256], 60)],
                    q4_weight(77, 256, 32, QuantType::Fp4, false, 61),
                ),
                cq(
                    "6x512 by 200x512 nf4 bs128 (rows of whole blocks, tiles, threads)",
                    vec![t(&[6, 512], 62)],
                    q4_weight(200, 512, 128, QuantType::Nf4, false, 63),
                ),
            ];
            if *bias {
                for (case, (n, seed)) in
                    v.iter_mut()
                        .zip([(37, 8), (100, 9), (100, 41), (200, 64), (77, 65), (200, 66)])
                {
                    case.inputs.push(t(&[n], seed));
                }
            }
            v
        }
        OpKind::Linear { bias } => {
            let mut inputs = vec![t(&[7, 65], 10), t(&[33, 65], 11)];
            if *bias {
                inputs.push(t(&[33], 12));
            }
            let mut big = vec![t(&[9, 200], 67), t(&[150, 200], 68)];
            if *bias {
                big.push(t(&[150], 69));
            }
            // LoRA's pairs: a rank-4 down and up projection, and the rank-1 product that
            // applies a bias delta to the rows of a batch that run the adapter.
            let mut down = vec![t(&[7, 65], 70), t(&[4, 65], 71)];
            let mut up = vec![t(&[7, 4], 72), t(&[33, 4], 73)];
            let mut rank1 = vec![t(&[7, 1], 74), t(&[33, 1], 75)];
            if *bias {
                down.push(t(&[4], 76));
                up.push(t(&[33], 77));
                rank1.push(t(&[33], 78));
            }
            vec![
                c("7x65 by 33x65", inputs),
                c("9x200 by 150x200 (threads)", big),
                c("LoRA down: 7x65 by 4x65", down),
                c("LoRA up: 7x4 by 33x4", up),
                c("rank 1: 7x1 by 33x1", rank1),
            ]
        }
        OpKind::MatMul { transpose_b } => {
            let b = if *transpose_b {
                t(&[3, 19, 37], 14)
            } else {
                t(&[3, 37, 19], 14)
            };
            vec![c("3x17x37 by 37x19", vec![t(&[3, 17, 37], 13), b])]
        }
        OpKind::Add | OpKind::Mul => vec![
            c("37x53 + 37x53", vec![t(&[37, 53], 15), t(&[37, 53], 16)]),
            c("37x53 + [53]", vec![t(&[37, 53], 17), t(&[53], 18)]),
        ],
        OpKind::Scale { .. }
        | OpKind::Silu
        | OpKind::Gelu
        | OpKind::GeluTanh
        | OpKind::QuickGelu => {
            let mut x = t(&[41, 67], 19);
            if let nibble_core::graph::HostData::F32(v) = &mut x.data {
                v.iter_mut().for_each(|a| *a *= 6.0);
            }
            vec![c("41x67 in [-6, 6)", vec![x])]
        }
        OpKind::Softmax => vec![c("29x300", vec![t(&[29, 300], 20)])],
        OpKind::RmsNorm { .. } => vec![c("37x96", vec![t(&[37, 96], 21), t(&[96], 22)])],
        OpKind::LayerNorm { affine, .. } => {
            let mut inputs = vec![t(&[37, 96], 23)];
            if *affine {
                inputs.push(t(&[96], 24));
                inputs.push(t(&[96], 25));
            }
            vec![c("37x96", inputs)]
        }
        OpKind::Rope { .. } => {
            let (tt, h, d) = (13, 3, 16);
            let ang: Vec<f32> = (0..tt * d / 2)
                .map(|i| (i as f32 * 0.37).sin() * 3.0)
                .collect();
            let cos =
                HostTensor::f32(&[tt, d / 2], ang.iter().map(|a| a.cos()).collect()).expect("cos");
            let sin =
                HostTensor::f32(&[tt, d / 2], ang.iter().map(|a| a.sin()).collect()).expect("sin");
            vec![c("13x3x16", vec![t(&[tt, h, d], 26), cos, sin])]
        }
        OpKind::Attention { key_mask, .. } => {
            let mut inputs = vec![t(&[4, 7, 16], 27), t(&[2, 11, 16], 28), t(&[2, 11, 16], 29)];
            if *key_mask {
                let m: Vec<f32> = (0..11)
                    .map(|j| if j == 3 || j == 9 { 0.0 } else { 1.0 })
                    .collect();
                inputs.push(HostTensor::f32(&[11], m).expect("mask"));
            }
            // Several query and key blocks of the CPU's blocked kernel (16 queries x 64 keys), of
            // wgpu's (64 rows x 64 keys) and CUDA's (64 rows x 32 keys),
            // ragged at both ends; masked, a whole key block of it.
            let mut blocked = vec![
                t(&[4, 70, 32], 73),
                t(&[2, 150, 32], 74),
                t(&[2, 150, 32], 75),
            ];
            if *key_mask {
                let m: Vec<f32> = (0..150)
                    .map(|j| {
                        if (64..128).contains(&j) || j % 7 == 3 {
                            0.0
                        } else {
                            1.0
                        }
                    })
                    .collect();
                blocked.push(HostTensor::f32(&[150], m).expect("mask"));
            }
            vec![
                c("q 4x7x16, kv 2x11x16 (GQA)", inputs),
                c("blocks: q 4x70x32, kv 2x150x32 (GQA)", blocked),
            ]
            .into_iter()
            .chain(key_mask.then(|| {
                // A decode step over a KV cache: one query, keys valid up to its position.
                let m: Vec<f32> = (0..40).map(|j| if j < 23 { 1.0 } else { 0.0 }).collect();
                c(
                    "decode: q 9x1x64 over a cache 3x40x64, 23 valid",
                    vec![
                        t(&[9, 1, 64], 70),
                        t(&[3, 40, 64], 71),
                        t(&[3, 40, 64], 72),
                        HostTensor::f32(&[40], m).expect("mask"),
                    ],
                )
            }))
            .collect()
        }
        OpKind::Embedding => {
            let ids = HostTensor::u32(&[9], vec![0, 5, 5, 76, 1, 30, 75, 2, 40]).expect("ids");
            vec![c("9 ids from 77x33", vec![ids, t(&[77, 33], 30)])]
        }
        OpKind::Concat { axis } => {
            let mut other = vec![5, 7, 3];
            other[*axis] = 2;
            let (a, b) = (t(&[5, 7, 3], 31), t(&other, 32));
            vec![c("5x7x3 with 2 more", vec![a, b])]
        }
        OpKind::Slice { .. } => vec![c("slice of 6x13x5", vec![t(&[6, 13, 5], 33)])],
        OpKind::Permute { perm } => {
            let shape: Vec<usize> = [3usize, 5, 7, 2][..perm.len()].to_vec();
            vec![c("rank 4", vec![t(&shape, 34)])]
        }
        OpKind::Reshape { .. } => vec![c("35x6 to 5x42", vec![t(&[35, 6], 35)])],
        OpKind::AdaLnModulate => vec![c(
            "37x96",
            vec![t(&[37, 96], 36), t(&[96], 37), t(&[96], 38)],
        )],
        OpKind::CacheWrite => {
            // Rows 5..8 of a 3-head cache of 11; the rest of the cache must stay as it was.
            let pos = HostTensor::u32(&[1], vec![5]).expect("pos");
            vec![c(
                "3 rows into 3x11x16 at 5",
                vec![t(&[3, 11, 16], 56), t(&[3, 3, 16], 57), pos],
            )]
        }
        OpKind::TimestepEmbedding { .. } => {
            let ts = HostTensor::f32(&[4], vec![0.0, 1.0, 250.5, 999.0]).expect("t");
            vec![c("t in [0, 1000)", vec![ts])]
        }
        OpKind::Conv2d { kernel, bias, .. } => {
            let k = *kernel;
            let mut inputs = vec![t(&[5, 7, 9], 60), t(&[6, 5, k, k], 61)];
            if *bias {
                inputs.push(t(&[6], 62));
            }
            // A wide image: more outputs than one band of im2col columns would hold in a
            // small test, odd sizes, the padding on every edge.
            let mut wide = vec![t(&[3, 40, 37], 63), t(&[4, 3, k, k], 64)];
            if *bias {
                wide.push(t(&[4], 65));
            }
            vec![
                c(&format!("5x7x9 -> 6 channels, {k}x{k}"), inputs),
                c(&format!("3x40x37 -> 4 channels, {k}x{k}"), wide),
            ]
        }
        OpKind::GroupNorm { .. } => vec![
            c(
                "8 channels x 5x7 in 4 groups",
                vec![t(&[8, 5, 7], 66), t(&[8], 67), t(&[8], 68)],
            ),
            c(
                "32 channels x 300 in 4 groups",
                vec![t(&[32, 300], 69), t(&[32], 70), t(&[32], 71)],
            ),
        ],
        OpKind::Upsample2x => vec![c("3x4x5", vec![t(&[3, 4, 5], 72)])],
    }
}

/// One op of each `OpKind` variant, with any parameters: [`branches`] expands it into every
/// parameter branch. A variant missing here fails
/// `every_op_kind_variant_and_parameter_branch_has_a_case`, which names it (the variants are
/// read from the enum's source).
fn representatives() -> Vec<OpKind> {
    vec![
        OpKind::Dequant4,
        OpKind::LinearQ4 { bias: true },
        OpKind::Linear { bias: true },
        OpKind::MatMul { transpose_b: false },
        OpKind::Add,
        OpKind::Mul,
        OpKind::Scale { factor: -0.37 },
        OpKind::RmsNorm { eps: 1e-6 },
        OpKind::LayerNorm {
            eps: 1e-6,
            affine: true,
        },
        OpKind::Silu,
        OpKind::QuickGelu,
        OpKind::Gelu,
        OpKind::GeluTanh,
        OpKind::Softmax,
        OpKind::Rope {
            mode: RopeMode::RotateHalf,
        },
        OpKind::Attention {
            causal: true,
            scale: 0.25,
            key_mask: false,
        },
        OpKind::Embedding,
        OpKind::Concat { axis: 0 },
        OpKind::Slice {
            axis: 1,
            start: 4,
            len: 6,
        },
        OpKind::Permute {
            perm: vec![2, 0, 3, 1],
        },
        OpKind::Reshape { shape: vec![5, 42] },
        OpKind::AdaLnModulate,
        OpKind::CacheWrite,
        OpKind::TimestepEmbedding {
            dim: 256,
            flip_sin_to_cos: true,
            downscale_freq_shift: 0.0,
            scale: 1.0,
            max_period: 10000.0,
        },
        OpKind::Conv2d {
            kernel: 3,
            pad: 1,
            bias: true,
        },
        OpKind::GroupNorm {
            groups: 4,
            eps: 1e-6,
        },
        OpKind::Upsample2x,
    ]
}

/// Every rope layout. Exhaustive: a new mode does not compile until it is listed.
fn rope_modes() -> Vec<RopeMode> {
    let all = [RopeMode::RotateHalf, RopeMode::Interleaved];
    for m in all {
        match m {
            RopeMode::RotateHalf | RopeMode::Interleaved => {}
        }
    }
    all.to_vec()
}

/// Every parameter branch of `op`'s variant that changes what a kernel does: each flag both
/// ways, each rope mode, each concat axis kind (first, inner, last), both kernel sizes of a
/// convolution. Exhaustive over `OpKind` (and destructuring every field), so a new variant or a
/// new parameter does not compile until its branches are listed here.
fn branches(op: &OpKind) -> Vec<OpKind> {
    let both = [false, true];
    match op {
        OpKind::LinearQ4 { bias: _ } => both.map(|bias| OpKind::LinearQ4 { bias }).to_vec(),
        OpKind::Linear { bias: _ } => both.map(|bias| OpKind::Linear { bias }).to_vec(),
        OpKind::MatMul { transpose_b: _ } => both
            .map(|transpose_b| OpKind::MatMul { transpose_b })
            .to_vec(),
        OpKind::LayerNorm { eps, affine: _ } => both
            .map(|affine| OpKind::LayerNorm { eps: *eps, affine })
            .to_vec(),
        OpKind::Rope { mode: _ } => rope_modes()
            .into_iter()
            .map(|mode| OpKind::Rope { mode })
            .collect(),
        OpKind::Attention {
            causal: _,
            scale,
            key_mask: _,
        } => both
            .iter()
            .flat_map(|&causal| {
                both.map(|key_mask| OpKind::Attention {
                    causal,
                    scale: *scale,
                    key_mask,
                })
            })
            .collect(),
        OpKind::Concat { axis: _ } => (0..3).map(|axis| OpKind::Concat { axis }).collect(),
        OpKind::Conv2d {
            kernel: _,
            pad: _,
            bias: _,
        } => [(3, 1), (1, 0)]
            .iter()
            .flat_map(|&(kernel, pad)| both.map(|bias| OpKind::Conv2d { kernel, pad, bias }))
            .collect(),
        OpKind::TimestepEmbedding {
            dim,
            flip_sin_to_cos: _,
            downscale_freq_shift,
            scale,
            max_period,
        } => both
            .map(|flip_sin_to_cos| OpKind::TimestepEmbedding {
                dim: *dim,
                flip_sin_to_cos,
                downscale_freq_shift: *downscale_freq_shift,
                scale: *scale,
                max_period: *max_period,
            })
            .to_vec(),
        OpKind::Dequant4
        | OpKind::Add
        | OpKind::Mul
        | OpKind::Scale { factor: _ }
        | OpKind::RmsNorm { eps: _ }
        | OpKind::Silu
        | OpKind::Gelu
        | OpKind::GeluTanh
        | OpKind::QuickGelu
        | OpKind::Softmax
        | OpKind::Embedding
        | OpKind::Slice {
            axis: _,
            start: _,
            len: _,
        }
        | OpKind::Permute { perm: _ }
        | OpKind::Reshape { shape: _ }
        | OpKind::AdaLnModulate
        | OpKind::CacheWrite
        | OpKind::GroupNorm { groups: _, eps: _ }
        | OpKind::Upsample2x => vec![op.clone()],
    }
}

/// Every op the table runs: each variant's every parameter branch.
fn ops() -> Vec<OpKind> {
    representatives().iter().flat_map(branches).collect()
}

/// The variant name of an op (`LinearQ4` of `LinearQ4 { bias: true }`).
fn variant_name(op: &OpKind) -> String {
    format!("{op:?}")
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect()
}

/// The variants of `OpKind` as its source declares them (the lines of the enum's body indented
/// one level that start with a capital letter).
fn declared_variants() -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/src/graph/ops.rs");
    let src = std::fs::read_to_string(&path).expect("read core/src/graph/ops.rs");
    let body = src
        .split("pub enum OpKind {")
        .nth(1)
        .expect("ops.rs declares `pub enum OpKind {`");
    let body = &body[..body.find("\n}").expect("the enum's closing brace")];
    body.lines()
        .filter(|l| l.starts_with("    ") && !l.starts_with("     "))
        .map(str::trim)
        .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
        .map(|l| {
            l.chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect()
        })
        .collect()
}

#[test]
fn every_op_kind_variant_and_parameter_branch_has_a_case() {
    let declared = declared_variants();
    assert!(declared.len() >= 20, "read {declared:?} from ops.rs");
    let ops = ops();
    let covered: std::collections::BTreeSet<String> = ops.iter().map(variant_name).collect();
    let missing: Vec<&String> = declared.iter().filter(|v| !covered.contains(*v)).collect();
    assert!(
        missing.is_empty(),
        "OpKind variants without a conformance case (add them to `representatives`): {missing:?}"
    );
    for op in &ops {
        assert!(!cases(op).is_empty(), "{}: no case", op_label(op));
        // Each branch is its own row: labels name the parameters that tell branches apart.
        let label = op_label(op);
        let same: Vec<&OpKind> = ops.iter().filter(|o| op_label(o) == label).collect();
        assert_eq!(same.len(), 1, "two branches share the row label {label}");
    }
    // The boolean flags and modes the kernels branch on: each value has a row.
    for want in [
        "linear_q4 (bias=false)",
        "linear (bias=false)",
        "attention (causal=true, key_mask=true)",
        "attention (causal=false, key_mask=false)",
        "layer_norm (affine=false)",
        "matmul (transpose_b=true)",
        "rope (Interleaved)",
        "conv2d (1x1, pad=0, bias=true)",
        "timestep_embedding (flip_sin_to_cos=false)",
    ] {
        assert!(ops.iter().any(|o| op_label(o) == want), "no row {want}");
    }
}

fn compare(got: &[f32], want: &[f32], tol: Tolerance) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} values, want {}", got.len(), want.len()));
    }
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        return Err(format!("non-finite value at {i}"));
    }
    match tol {
        Tolerance::Exact => {
            match (0..got.len()).find(|&i| canon_bits(got[i]) != canon_bits(want[i])) {
                Some(i) => Err(format!("element {i}: {} != {}", got[i], want[i])),
                None => Ok(()),
            }
        }
        Tolerance::RelToMax(r) => {
            let e = max_err_rel_to_max(got, want);
            if e <= r {
                Ok(())
            } else {
                Err(format!("error {e:.3e} x max > {r:e}"))
            }
        }
        Tolerance::Abs(a) => {
            let e = got
                .iter()
                .zip(want)
                .fold(0f64, |m, (g, w)| m.max((*g as f64 - *w as f64).abs()));
            if e <= a {
                Ok(())
            } else {
                Err(format!("abs error {e:.3e} > {a:e}"))
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Cell {
    Pass,
    Fail,
    Unsupported,
    Absent,
}

impl Cell {
    fn text(self) -> &'static str {
        match self {
            Cell::Pass => "pass",
            Cell::Fail => "FAIL",
            Cell::Unsupported => "unsupported",
            Cell::Absent => "absent",
        }
    }
    fn merge(self, other: Cell) -> Cell {
        match (self, other) {
            (Cell::Fail, _) | (_, Cell::Fail) => Cell::Fail,
            (Cell::Unsupported, _) | (_, Cell::Unsupported) => Cell::Unsupported,
            (a, _) => a,
        }
    }
}

fn op_label(op: &OpKind) -> String {
    let opts = match op {
        OpKind::LinearQ4 { bias } | OpKind::Linear { bias } => format!("bias={bias}"),
        OpKind::MatMul { transpose_b } => format!("transpose_b={transpose_b}"),
        OpKind::LayerNorm { affine, .. } => format!("affine={affine}"),
        OpKind::Rope { mode } => format!("{mode:?}"),
        OpKind::Attention {
            causal, key_mask, ..
        } => format!("causal={causal}, key_mask={key_mask}"),
        OpKind::Concat { axis } => format!("axis={axis}"),
        OpKind::Conv2d { kernel, pad, bias } => {
            format!("{kernel}x{kernel}, pad={pad}, bias={bias}")
        }
        OpKind::TimestepEmbedding {
            flip_sin_to_cos, ..
        } => format!("flip_sin_to_cos={flip_sin_to_cos}"),
        _ => String::new(),
    };
    if opts.is_empty() {
        op.name().to_string()
    } else {
        format!("{} ({opts})", op.name())
    }
}

#[test]
fn every_op_on_every_backend_matches_cpu_ref() {
    let mut wgpu = wgpu_or_absent("conformance");
    if let Some(b) = &wgpu {
        println!("wgpu adapter: {}", b.describe());
    }
    // Absent CUDA is a skip, except where the GPU check demands it (NIBBLE_REQUIRE_CUDA=1).
    let mut cuda = cuda_or_absent("conformance");
    if let Some(b) = &cuda {
        println!("cuda device: {}", b.describe());
    }
    let mut fast = nibble_core::backend::cpu::CpuBackend::new();
    println!("cpu backend: {}", fast.describe());
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for op in ops() {
        let mut cpu = Cell::Pass;
        let mut cpu_fast = Cell::Pass;
        let mut gpu = if wgpu.is_some() {
            Cell::Pass
        } else {
            Cell::Absent
        };
        let mut cu = if cuda.is_some() {
            Cell::Pass
        } else {
            Cell::Absent
        };
        for case in cases(&op) {
            let inputs: Vec<&HostTensor> = case.inputs.iter().collect();
            let q4 = case.q4.as_ref().map(|(s, p)| Q4Ref {
                state: s,
                packed: p,
            });
            let want = match cpu_ref::run(&case.op, &inputs, q4) {
                Ok(w) => w,
                Err(e) => {
                    cpu = Cell::Fail;
                    failures.push(format!("cpu_ref {} [{}]: {e}", op_label(&op), case.label));
                    continue;
                }
            };
            if want.as_f32().iter().any(|v| !v.is_finite()) {
                cpu = Cell::Fail;
                failures.push(format!(
                    "cpu_ref {} [{}]: non-finite output",
                    op_label(&op),
                    case.label
                ));
            }
            {
                let cell = match run_on_backend(&mut fast, &case.op, &inputs, q4) {
                    Ok(got) => match compare(got.as_f32(), want.as_f32(), tolerance(&case.op)) {
                        Ok(()) => Cell::Pass,
                        Err(e) => {
                            failures.push(format!("cpu {} [{}]: {e}", op_label(&op), case.label));
                            Cell::Fail
                        }
                    },
                    Err(e) => {
                        failures.push(format!("cpu {} [{}]: {e}", op_label(&op), case.label));
                        Cell::Fail
                    }
                };
                cpu_fast = cpu_fast.merge(cell);
            }
            if let Some(b) = wgpu.as_mut() {
                let cell = if !b.supports(&case.op) {
                    Cell::Unsupported
                } else {
                    match b.run(&case.op, &inputs, q4) {
                        Ok(got) if got.info != want.info => {
                            failures.push(format!(
                                "wgpu {} [{}]: shape {:?} != {:?}",
                                op_label(&op),
                                case.label,
                                got.info,
                                want.info
                            ));
                            Cell::Fail
                        }
                        Ok(got) => {
                            match compare(got.as_f32(), want.as_f32(), tolerance(&case.op)) {
                                Ok(()) => Cell::Pass,
                                Err(e) => {
                                    failures.push(format!(
                                        "wgpu {} [{}]: {e}",
                                        op_label(&op),
                                        case.label
                                    ));
                                    Cell::Fail
                                }
                            }
                        }
                        Err(e) => {
                            failures.push(format!("wgpu {} [{}]: {e}", op_label(&op), case.label));
                            Cell::Fail
                        }
                    }
                };
                gpu = gpu.merge(cell);
            }
            if let Some(b) = cuda.as_mut() {
                // run_on_backend asks the backend whether it runs the op on these shapes.
                let cell = {
                    match run_on_backend(b, &case.op, &inputs, q4) {
                        Ok(got) => match compare(
                            got.as_f32(),
                            want.as_f32(),
                            cuda_tolerance(&case.op, &inputs),
                        ) {
                            Ok(()) => Cell::Pass,
                            Err(e) => {
                                failures.push(format!(
                                    "cuda {} [{}]: {e}",
                                    op_label(&op),
                                    case.label
                                ));
                                Cell::Fail
                            }
                        },
                        Err(e) => {
                            failures.push(format!("cuda {} [{}]: {e}", op_label(&op), case.label));
                            Cell::Fail
                        }
                    }
                };
                cu = cu.merge(cell);
            }
        }
        rows.push((op_label(&op), cpu, cpu_fast, gpu, cu));
    }
    let mut table = String::from("| op | cpu_ref | cpu | wgpu | cuda |\n|---|---|---|---|---|\n");
    for (name, cpu, cpu_fast, gpu, cu) in &rows {
        // A backend that is absent on this machine is printed as absent, never as passed.
        table.push_str(&format!(
            "| {name} | {} | {} | {} | {} |\n",
            cpu.text(),
            cpu_fast.text(),
            gpu.text(),
            cu.text()
        ));
    }
    println!("\n{table}");
    assert!(
        failures.is_empty(),
        "conformance failures:\n{}",
        failures.join("\n")
    );
    // Every kernel of the wgpu backend has a row (linear_q4_tiled is linear_q4's path for more
    // than 8 rows, covered by the "(tiled)" case; attention_rows attention's for fewer than 32
    // query rows, covered by the 7-row case beside the 70-row one).
    for (kernel, _) in nibble_wgpu::SHADERS {
        let op = kernel.trim_end_matches("_tiled").trim_end_matches("_rows");
        assert!(
            rows.iter().any(|(n, ..)| n.split(' ').next() == Some(op)),
            "kernel {kernel} has no case"
        );
    }
}

/// cpu_ref itself against bitsandbytes' outputs: dequantization bit-exact and the 4-bit linear
/// within 1e-5, through the graph op interface.
#[test]
fn cpu_ref_ops_match_the_bitsandbytes_fixture() {
    let model = ModelIndex::open(&fixture("linear4bit/layers.safetensors")).expect("open");
    let expected = Expected::open(&fixture("linear4bit/expected.safetensors"));
    for keys in model.q4_weights().map(<[_]>::to_vec).expect("find") {
        let name = keys.base.trim_end_matches(".weight").to_string();
        let state = model.quant_state(&keys).expect("state");
        let packed = model
            .read_bytes(model.require(&keys.base).expect("p"))
            .expect("read");
        let q4 = Q4Ref {
            state: &state,
            packed: &packed,
        };
        let deq = cpu_ref::run(&OpKind::Dequant4, &[], Some(q4)).expect("dequant4");
        assert_bits_eq(
            deq.as_f32(),
            &expected.f32(&format!("{name}.deq_f32")).expect("deq"),
            &name,
        );
        let x = expected.f32(&format!("{name}.x")).expect("x");
        let k = state.json.shape[1] as usize;
        let xt = HostTensor::f32(&[x.len() / k, k], x).expect("x");
        let bias = model
            .get(&format!("{name}.bias"))
            .map(|e| model.read_f32(e).expect("bias"));
        let bt = bias.map(|b| HostTensor::f32(&[b.len()], b).expect("b"));
        let mut inputs = vec![&xt];
        inputs.extend(bt.as_ref());
        let y = cpu_ref::run(&OpKind::LinearQ4 { bias: bt.is_some() }, &inputs, Some(q4))
            .expect("linear");
        let err = max_err_rel_to_max(y.as_f32(), &expected.f32(&format!("{name}.y")).expect("y"));
        assert!(err <= 1e-5, "{name}: {err:e}");
    }
}

/// A 4-bit weight larger than one storage binding is split into row pieces. The split path is
/// driven here by capping the binding size at 40000 bytes (the adapter's own limit is 128 MiB on
/// lavapipe, too large for a quick test).
#[test]
fn linear_q4_over_the_binding_limit_is_split() {
    let Some(b) = wgpu_or_absent("split 4-bit weight") else {
        return;
    };
    let mut b = b.with_max_binding(40_000);
    let (state, packed) = q4_weight(600, 512, 64, QuantType::Nf4, true, 42);
    assert!(
        packed.len() > 40_000 * 3,
        "the weight spans several bindings"
    );
    for rows in [3usize, 16] {
        let x = t(&[rows, 512], 43);
        let bias = t(&[600], 44);
        let op = OpKind::LinearQ4 { bias: true };
        let q4 = Some(Q4Ref {
            state: &state,
            packed: &packed,
        });
        let want = cpu_ref::run(&op, &[&x, &bias], q4).expect("cpu_ref");
        let got = b.run(&op, &[&x, &bias], q4).expect("wgpu split");
        compare(got.as_f32(), want.as_f32(), tolerance(&op))
            .unwrap_or_else(|e| panic!("{rows} rows: {e}"));
    }
}

/// Dense weights over the binding limit (an lm_head, an embedding table) are bound as row pieces.
#[test]
fn dense_weights_over_the_binding_limit_are_split() {
    let Some(b) = wgpu_or_absent("split dense weights") else {
        return;
    };
    let mut b = b.with_max_binding(40_000);
    let cases: Vec<(OpKind, Vec<HostTensor>)> = vec![
        (
            OpKind::Linear { bias: true },
            vec![t(&[3, 64], 50), t(&[300, 64], 51), t(&[300], 52)],
        ),
        (
            OpKind::Linear { bias: false },
            vec![t(&[12, 64], 53), t(&[300, 64], 54)],
        ),
        (
            OpKind::Embedding,
            vec![
                HostTensor::u32(&[6], vec![0, 299, 150, 7, 151, 298]).expect("ids"),
                t(&[300, 64], 55),
            ],
        ),
    ];
    for (op, inputs) in cases {
        let refs: Vec<&HostTensor> = inputs.iter().collect();
        assert!(
            inputs[1].info.numel() * 4 > 40_000,
            "the weight is over the cap"
        );
        let want = cpu_ref::run(&op, &refs, None).expect("cpu_ref");
        let got = b.run(&op, &refs, None).expect("split");
        compare(got.as_f32(), want.as_f32(), tolerance(&op))
            .unwrap_or_else(|e| panic!("{}: {e}", op.name()));
    }
}

/// Attention whose scores overflow (or are NaN) gives NaN rows on every backend, never zeros
/// that look like a fully masked row: the run's output check then stops with an error instead
/// of printing tokens from garbage (fault class 12).
#[test]
fn attention_scores_that_overflow_are_nan_rows_on_every_backend() {
    let op = OpKind::Attention {
        causal: true,
        scale: 0.25,
        key_mask: false,
    };
    // Head 0: scores of +-1e60 (infinite in f32); head 1: NaN queries; head 2: finite.
    let (tq, tk, d) = (3, 5, 8);
    let mut qv = random_values(3 * tq * d, 90);
    qv[..tq * d].iter_mut().for_each(|x| *x *= 1e30);
    qv[tq * d..2 * tq * d]
        .iter_mut()
        .for_each(|x| *x = f32::NAN);
    let mut kv = random_values(3 * tk * d, 91);
    kv[..tk * d].iter_mut().for_each(|x| *x *= 1e30);
    let q = HostTensor::f32(&[3, tq, d], qv).expect("q");
    let k = HostTensor::f32(&[3, tk, d], kv).expect("k");
    let v = t(&[3, tk, d], 92);
    let inputs = [&q, &k, &v];
    let check = |label: &str, out: &HostTensor| {
        let o = out.as_f32();
        for (h, rows) in o.chunks(tq * d).enumerate() {
            if h < 2 {
                assert!(
                    rows.iter().all(|x| x.is_nan()),
                    "{label}: head {h} should be NaN, got {rows:?}"
                );
            } else {
                assert!(rows.iter().all(|x| x.is_finite()), "{label}: head {h}");
            }
        }
    };
    check(
        "cpu_ref",
        &cpu_ref::run(&op, &inputs, None).expect("cpu_ref"),
    );
    let mut fast = nibble_core::backend::cpu::CpuBackend::new();
    check(
        "cpu",
        &run_on_backend(&mut fast, &op, &inputs, None).expect("cpu"),
    );
    if let Some(mut b) = wgpu_or_absent("attention overflow") {
        check("wgpu", &b.run(&op, &inputs, None).expect("wgpu"));
    }
    if let Some(mut b) = cuda_or_absent("attention overflow") {
        check(
            "cuda",
            &run_on_backend(&mut b, &op, &inputs, None).expect("cuda"),
        );
    }
}
