//! Helpers shared by nibble's integration tests: where the fixtures are, reading expected
//! tensors, and the named comparisons (bit-exact with -0.0 == +0.0, error relative to max).

pub mod batch;
pub mod build;
pub mod gguf;
pub mod http_server;
pub mod llama;
pub mod process;
pub mod text;
pub mod video;

use std::path::{Path, PathBuf};

use nibble_core::io::model::ModelIndex;
use sha2::{Digest, Sha256};

/// `../shared/fixtures` relative to the repository root (or `$NIBBLE_FIXTURES`, for test binaries
/// carried to another machine); panics with a clear message if absent.
pub fn fixtures_dir() -> PathBuf {
    let p = std::env::var_os("NIBBLE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"));
    assert!(
        p.join("manifest.json").is_file(),
        "the shared fixtures are missing: expected {} (the folder `shared/fixtures` next to the \
         repository). Tests read them from there and never copy them into the repo.",
        p.display()
    );
    p
}

/// Writes a synthetic NF4 model of `arch` (`llama`, `dit`) and about `size` (`48MiB`) with the
/// `nibble` binary at `nibble` into `out`; the synthesis must succeed.
pub fn synth(nibble: &Path, arch: &str, size: &str, seed: u64, out: &Path) {
    let st = std::process::Command::new(nibble)
        .args(["synth", "--arch", arch, "--size", size, "--seed"])
        .arg(seed.to_string())
        .arg("-o")
        .arg(out)
        .output()
        .expect("nibble synth");
    assert!(
        st.status.success(),
        "nibble synth {arch} {size}: {}",
        String::from_utf8_lossy(&st.stderr)
    );
}

/// Copies a folder and its subfolders (files only) into `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else if p.is_file() {
            std::fs::copy(&p, to.join(e.file_name())).expect("copy");
        }
    }
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

/// `max |got - want|`.
pub fn max_abs_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    got.iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - *w as f64).abs()))
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

/// Tensor `name` of `m` as f32 (any float dtype), or a panic naming it.
pub fn tensor_f32(m: &ModelIndex, name: &str) -> Vec<f32> {
    m.read_f32(m.require(name).unwrap_or_else(|e| panic!("{name}: {e}")))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// sha256 (hex) of little-endian f32 bytes with -0.0 canonicalized, as the fixture manifests use.
pub fn sha256_canon_f32(v: &[f32]) -> String {
    let mut h = Sha256::new();
    for x in v {
        h.update(canon_bits(*x).to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

pub use nibble_core::backend::run_op as run_on_backend;

/// The wgpu backend when an adapter is present; `None` (printed as absent) otherwise. CI installs
/// Mesa's lavapipe and sets `NIBBLE_REQUIRE_WGPU=1`: there an absent adapter is a failure, not a
/// skip.
pub fn wgpu_or_absent(what: &str) -> Option<nibble_wgpu::WgpuBackend> {
    match nibble_wgpu::WgpuBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                std::env::var("NIBBLE_REQUIRE_WGPU").ok().as_deref() != Some("1"),
                "wgpu required but absent: {e}"
            );
            println!("{what}: wgpu absent ({e}), not run");
            None
        }
    }
}

/// The CUDA backend when a driver and device are present; `None` (printed as absent) otherwise.
/// With `NIBBLE_REQUIRE_CUDA=1` (the GPU check) an absent CUDA is a failure, not a skip.
pub fn cuda_or_absent(what: &str) -> Option<nibble_cuda::CudaBackend> {
    match nibble_cuda::CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                std::env::var("NIBBLE_REQUIRE_CUDA").ok().as_deref() != Some("1"),
                "CUDA required but absent: {e}"
            );
            println!("{what}: cuda absent ({e}), not run");
            None
        }
    }
}

/// Every weight resident (a 1 GiB device budget), or (`streamed`) every group streamed through
/// two 64 KiB slots at the smallest device budget: the two placements the fixture tests run.
pub fn run_opts<B: nibble_core::backend::Backend>(
    g: &nibble_core::graph::Graph,
    m: &ModelIndex,
    b: &mut B,
    streamed: bool,
) -> nibble_core::exec::ExecOptions {
    let device_bytes = if streamed {
        nibble_core::plan::min_device_bytes(g, m, b).expect("min device budget")
    } else {
        1 << 30
    };
    nibble_core::exec::ExecOptions {
        budgets: nibble_core::plan::Budgets {
            device_bytes,
            ring_slots: 2,
            slot_bytes: 64 << 10,
            host_tier_bytes: 0,
        },
        readers: 2,
        stream_all: streamed,
        naive: false,
    }
}

/// Inside `impl Backend for W` where `W` wraps another backend in its field `inner`: the named
/// [`nibble_core::backend::Backend`] methods, passed through to `inner` unchanged (for test
/// backends that observe or alter a few calls and forward the rest).
#[macro_export]
macro_rules! forward_to_inner {
    ($($m:ident),* $(,)?) => { $( $crate::forward_to_inner!(@ $m); )* };
    (@ supports) => {
        fn supports(
            &self,
            o: &nibble_core::backend::OpShapes<'_>,
        ) -> ::std::result::Result<(), String> {
            self.inner.supports(o)
        }
    };
    (@ device_info) => {
        fn device_info(&self) -> nibble_core::backend::DeviceInfo {
            self.inner.device_info()
        }
    };
    (@ workspace) => {
        fn workspace(
            &self,
            ops: &[nibble_core::backend::OpShapes<'_>],
        ) -> nibble_core::backend::Workspace {
            self.inner.workspace(ops)
        }
    };
    (@ allocate) => {
        fn allocate(&mut self, words: usize, pool: u64, workspace: u64) -> nibble_core::Result<()> {
            self.inner.allocate(words, pool, workspace)
        }
    };
    (@ release) => {
        fn release(&mut self) {
            self.inner.release()
        }
    };
    (@ write_arena) => {
        fn write_arena(
            &mut self,
            dst: nibble_core::backend::ArenaSlice,
            words: &[u32],
        ) -> nibble_core::Result<()> {
            self.inner.write_arena(dst, words)
        }
    };
    (@ read_arena) => {
        fn read_arena(
            &mut self,
            src: nibble_core::backend::ArenaSlice,
        ) -> nibble_core::Result<Vec<u32>> {
            self.inner.read_arena(src)
        }
    };
    (@ upload) => {
        fn upload(
            &mut self,
            offset: u64,
            bytes: &[u8],
        ) -> nibble_core::Result<Box<dyn nibble_core::stream::ring::Fence>> {
            self.inner.upload(offset, bytes)
        }
    };
    (@ run) => {
        fn run(
            &mut self,
            op: &nibble_core::graph::OpKind,
            inputs: &[nibble_core::backend::Operand],
            q4: Option<&nibble_core::backend::Q4View>,
            out: &nibble_core::backend::Operand,
        ) -> nibble_core::Result<()> {
            self.inner.run(op, inputs, q4, out)
        }
    };
    (@ host_memory) => {
        fn host_memory(&mut self) -> Option<&mut dyn nibble_core::backend::HostMemory> {
            self.inner.host_memory()
        }
    };
}
