//! Helpers shared by nibble's integration tests: where the fixtures are, reading expected
//! tensors, and the named comparisons (bit-exact with -0.0 == +0.0, error relative to max).

pub mod build;
pub mod http_server;

use std::path::{Path, PathBuf};

use nibble_core::index::ModelIndex;
use sha2::{Digest, Sha256};

/// `../shared/fixtures` relative to the repository root; panics with a clear message if absent.
pub fn fixtures_dir() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures");
    assert!(
        p.join("manifest.json").is_file(),
        "the shared fixtures are missing: expected {} (the folder `shared/fixtures` next to the \
         repository). Tests read them from there and never copy them into the repo.",
        p.display()
    );
    p
}

/// A fixture path below `fixtures_dir()`.
pub fn fixture(rel: &str) -> PathBuf {
    fixtures_dir().join(rel)
}

/// Reads a JSON file.
pub fn read_json(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An `expected.safetensors` file.
pub struct Expected {
    index: ModelIndex,
}

impl Expected {
    /// Opens a safetensors file of expected values.
    pub fn open(path: &Path) -> Self {
        let index = ModelIndex::open(path).unwrap_or_else(|e| panic!("{e}"));
        Expected { index }
    }

    /// A float tensor widened to f32, if present.
    pub fn f32(&self, name: &str) -> Option<Vec<f32>> {
        let e = self.index.get(name)?;
        Some(self.index.read_f32(e).unwrap_or_else(|e| panic!("{e}")))
    }

    /// Raw bytes of a tensor, if present.
    pub fn bytes(&self, name: &str) -> Option<Vec<u8>> {
        let e = self.index.get(name)?;
        Some(self.index.read_bytes(e).unwrap_or_else(|e| panic!("{e}")))
    }

    /// The index itself.
    pub fn index(&self) -> &ModelIndex {
        &self.index
    }
}

/// f32 bits with -0.0 mapped to +0.0.
pub fn canon_bits(v: f32) -> u32 {
    if v == 0.0 {
        0
    } else {
        v.to_bits()
    }
}

/// Asserts bit equality (treating -0.0 == +0.0), naming the first differing index.
pub fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| canon_bits(got[i]) != canon_bits(want[i])) {
        panic!(
            "{what}: element {i} differs: got {} ({:#010x}), want {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// `max |got - want| / max |want|`.
pub fn max_err_rel_to_max(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let m = want.iter().fold(0f64, |m, v| m.max((*v as f64).abs()));
    let e = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - *w as f64).abs()));
    if m == 0.0 {
        e
    } else {
        e / m
    }
}

/// sha256 (hex) of little-endian f32 bytes with -0.0 canonicalized, as the fixture manifests use.
pub fn sha256_canon_f32(v: &[f32]) -> String {
    let mut h = Sha256::new();
    for x in v {
        h.update(canon_bits(*x).to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs one op on any [`nibble_core::backend::Backend`] the way the executor does (operands in a
/// freshly allocated arena, the 4-bit weight in the pool) and reads the result back.
pub fn run_on_backend<B: nibble_core::backend::Backend>(
    b: &mut B,
    op: &nibble_core::graph::OpKind,
    inputs: &[&nibble_core::graph::HostTensor],
    q4: Option<nibble_core::cpu_ref::Q4Ref<'_>>,
) -> nibble_core::Result<nibble_core::graph::HostTensor> {
    use nibble_core::backend::{host_words, ArenaSlice, Operand, PoolRegion, Q4View};
    use nibble_core::graph::{infer, HostTensor};
    let infos: Vec<_> = inputs.iter().map(|t| &t.info).collect();
    let out_info = infer(op, &infos, q4.map(|q| q.info()).as_ref())?;
    let align = b.arena_align_words().max(1);
    let mut cursor = 0usize;
    let mut place = |n: usize| {
        let s = ArenaSlice {
            offset: cursor,
            len: n,
        };
        cursor = (cursor + n.max(1)).div_ceil(align) * align;
        s
    };
    let ins: Vec<Operand> = inputs
        .iter()
        .map(|t| Operand {
            slice: place(t.info.numel()),
            info: t.info.clone(),
        })
        .collect();
    let out = Operand {
        slice: place(out_info.numel()),
        info: out_info.clone(),
    };
    let pa = b.pool_align_bytes().max(4);
    let view = q4.map(|q| {
        let packed = PoolRegion {
            offset: 0,
            len: q.packed.len() as u64,
        };
        let absmax = PoolRegion {
            offset: packed.len.div_ceil(pa) * pa,
            len: q.state.absmax.len() as u64 * 4,
        };
        let code = PoolRegion {
            offset: (absmax.offset + absmax.len).div_ceil(pa) * pa,
            len: 64,
        };
        Q4View {
            packed,
            absmax,
            code,
            shape: q.info().shape,
            blocksize: q.info().blocksize,
        }
    });
    b.allocate(
        cursor.max(1),
        view.as_ref().map(|v| v.code.offset + 64).unwrap_or(pa),
    )?;
    for (o, t) in ins.iter().zip(inputs) {
        b.write_arena(o.slice, &host_words(t))?;
    }
    if let (Some(v), Some(q)) = (&view, q4) {
        b.upload(v.packed.offset, q.packed)?.wait();
        let absmax: Vec<u8> = q
            .state
            .absmax
            .iter()
            .flat_map(|a| a.to_le_bytes())
            .collect();
        b.upload(v.absmax.offset, &absmax)?.wait();
        let code: Vec<u8> = q.state.code.iter().flat_map(|a| a.to_le_bytes()).collect();
        b.upload(v.code.offset, &code)?.wait();
    }
    b.run(op, &ins, view.as_ref(), &out)?;
    let words = b.read_arena(out.slice)?;
    HostTensor::f32(
        &out_info.shape,
        words.into_iter().map(f32::from_bits).collect(),
    )
}
