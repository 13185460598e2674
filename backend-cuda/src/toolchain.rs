//! What the CUDA backend loads at run time and how its kernels are built: the libraries checked
//! before the first CUDA call (driver, NVRTC, cuBLAS) and their versions; each kernel compiled
//! by NVRTC to a CUBIN for the device (PTX as the fallback), cached on disk under a key of its
//! source, options and NVRTC version; the bf16 rounding the kernels do with bit operations.

use cudarc::nvrtc::Ptx;

use crate::CudaError;

/// Whether the CUDA driver library can be loaded (no CUDA call is made).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether cuBLAS can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// The libraries the backend loads that cannot be: one message naming each (empty when all
/// are there). Checked before the first CUDA call, so a missing one is an error value here,
/// not a failure to load in the middle of a run.
pub fn missing_libraries() -> Vec<String> {
    let mut v = Vec::new();
    if !driver_present() {
        v.push("libcuda.so.1 (the driver) is not on the library path".into());
    }
    if !nvrtc_present() {
        v.push(
            "NVRTC (libnvrtc.so.13) is not on the library path: install the CUDA 13.0 toolkit \
             or the nvidia-cuda-nvrtc==13.0.88 wheel and add its lib folder to LD_LIBRARY_PATH"
                .into(),
        );
    }
    if !cublas_present() {
        v.push(
            "cuBLAS (libcublas.so.13) is not on the library path: install the CUDA 13.0 \
             toolkit or the nvidia-cublas wheel and add its lib folder to LD_LIBRARY_PATH"
                .into(),
        );
    }
    v
}

/// NVRTC's version (major, minor).
pub(crate) fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: two out-parameters.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Nvrtc(format!("nvrtcVersion: {r:?}")));
    }
    Ok((a, b))
}

/// The driver's CUDA version (major, minor).
pub(crate) fn driver_version() -> Result<(i32, i32), CudaError> {
    let mut v = 0;
    // SAFETY: one out-parameter.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver(format!("cuDriverGetVersion: {r:?}")));
    }
    Ok((v / 1000, v % 1000 / 10))
}

/// f32 to bf16 bits as the `to_bf16` and `dequant_bf16` kernels compute it (round to nearest
/// even, NaN kept quiet): the same operations, for the test that they equal the CPU's.
pub fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        ((u >> 16) | 0x40) as u16
    } else {
        (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }
}

/// The compiled image of kernel `name` for `arch` (sm_XY) and where it came from: a CUBIN for
/// the device's own architecture (nothing left for the driver to compile at load time), or PTX
/// for its virtual one when NVRTC cannot make the CUBIN; from the disk cache when it is there.
/// The cache key holds everything the output depends on: the source, the options, NVRTC's
/// version; files are written whole (renamed into place).
pub(crate) fn kernel_image(
    name: &str,
    src: &str,
    arch: &str,
    nvrtc: (i32, i32),
) -> Result<(Ptx, &'static str), CudaError> {
    let options = ["--std=c++17"];
    let tag = format!(
        "{name}-{arch}-nvrtc{}.{}-{:016x}",
        nvrtc.0,
        nvrtc.1,
        fnv(format!("{src}\n{options:?}").as_bytes())
    );
    let dir = cache_dir();
    let cached = |ext: &str| {
        dir.as_ref()
            .and_then(|d| std::fs::read(d.join(format!("{tag}.{ext}"))).ok())
    };
    if let Some(b) = cached("cubin") {
        return Ok((Ptx::from_binary(b), "CUBIN"));
    }
    if let Some(b) = cached("ptx") {
        let text = String::from_utf8(b).map_err(|e| CudaError::Nvrtc(e.to_string()))?;
        return Ok((Ptx::from_src(text), "PTX"));
    }
    match nvrtc_compile(src, arch, &options, true) {
        Ok(cubin) => {
            store(dir.as_deref(), &format!("{tag}.cubin"), &cubin);
            Ok((Ptx::from_binary(cubin), "CUBIN"))
        }
        Err(cubin_err) => {
            let virt = arch.replacen("sm_", "compute_", 1);
            let ptx = nvrtc_compile(src, &virt, &options, false).map_err(|e| {
                CudaError::Nvrtc(format!("{name}: as a CUBIN: {cubin_err}; as PTX: {e}"))
            })?;
            store(dir.as_deref(), &format!("{tag}.ptx"), &ptx);
            let text = String::from_utf8(ptx).map_err(|e| CudaError::Nvrtc(e.to_string()))?;
            Ok((Ptx::from_src(text), "PTX"))
        }
    }
}

fn cache_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("NIBBLE_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache/nibble"))
        })
        .map(|d| d.join("cuda-kernels"))
}

/// Compiles `src` with NVRTC for `arch`: the CUBIN when `cubin` (a real architecture, sm_XY),
/// else the PTX text (a virtual one, compute_XY).
fn nvrtc_compile(src: &str, arch: &str, options: &[&str], cubin: bool) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    let csrc = std::ffi::CString::new(src).map_err(|e| e.to_string())?;
    let prog = result::create_program(&csrc, None).map_err(|e| format!("{e:?}"))?;
    let mut opts: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    opts.extend(options.iter().map(|o| o.to_string()));
    // SAFETY: a program made above, destroyed below on every path.
    let out = unsafe {
        match result::compile_program(prog, &opts) {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> =
                            l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(format!("{e:?}: {log}"))
            }
            Ok(()) if cubin => {
                let mut n = 0usize;
                let r = sys::nvrtcGetCUBINSize(prog, &mut n);
                if r != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
                    Err(format!("nvrtcGetCUBINSize: {r:?}"))
                } else {
                    let mut buf = vec![0u8; n];
                    let r = sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char);
                    if r == sys::nvrtcResult::NVRTC_SUCCESS {
                        Ok(buf)
                    } else {
                        Err(format!("nvrtcGetCUBIN: {r:?}"))
                    }
                }
            }
            Ok(()) => result::get_ptx(prog)
                .map(|p| p.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect())
                .map_err(|e| format!("{e:?}")),
        }
    };
    // SAFETY: created above and not used after.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// Writes a compiled kernel into the cache whole or not at all (a new file renamed into place:
/// a reader never sees half of one, two writers never mix).
fn store(dir: Option<&std::path::Path>, file: &str, bytes: &[u8]) {
    let Some(dir) = dir else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    // Unique per process and call: two backends of one process may compile the same kernel.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{file}.{}-{n}.tmp", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, dir.join(file)).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CudaBackend;

    #[test]
    fn the_kernels_bf16_rounding_equals_the_cpus() {
        // Ties both ways, carries into the exponent, the largest finite values, infinities,
        // NaNs with payloads, subnormals, and a sweep of bit patterns.
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            1.0078125,
            -1.0078125,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN_POSITIVE,
            1e-45,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc1_2345),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x7f7f_ffff),
        ];
        let mut u = 0x1234_5678u32;
        for _ in 0..1_000_000 {
            u = u.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            xs.push(f32::from_bits(u));
        }
        for x in xs {
            assert_eq!(
                bf16_bits(x),
                half::bf16::from_f32(x).to_bits(),
                "{x:e} ({:08x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn missing_libraries_are_named_in_an_error_value() {
        let missing = missing_libraries();
        assert_eq!(
            missing.iter().any(|m| m.contains("libcuda")),
            !driver_present()
        );
        assert_eq!(
            missing.iter().any(|m| m.contains("cuBLAS")),
            !cublas_present()
        );
        assert_eq!(
            missing.iter().any(|m| m.contains("NVRTC")),
            !nvrtc_present()
        );
        if !missing.is_empty() {
            let e = CudaBackend::new()
                .expect_err("a library is missing")
                .to_string();
            for m in &missing {
                assert!(e.contains(m.as_str()), "{e} does not name {m}");
            }
        }
    }
}
