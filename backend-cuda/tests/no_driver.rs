//! Without CUDA the backend is an error value, never a panic; with CUDA it opens.

use nibble_cuda::{driver_present, nvrtc_present, CudaBackend, CudaError, KERNELS};

#[test]
fn opening_without_a_driver_is_an_error_not_a_panic() {
    match CudaBackend::new() {
        Ok(b) => {
            assert!(driver_present() && nvrtc_present());
            println!("CUDA present: {}", b.describe());
        }
        Err(CudaError::NoDriver(msg)) => {
            let text = CudaError::NoDriver(msg.clone()).to_string();
            assert!(text.starts_with("no CUDA driver found: "), "{text}");
            println!("absent, as expected here: {text}");
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn every_kernel_file_is_embedded_and_names_its_entry_point() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("kernels")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    files.sort();
    let embedded: Vec<String> = KERNELS.iter().map(|(n, _)| format!("{n}.cu")).collect();
    assert_eq!(files, embedded);
    for (name, src) in KERNELS {
        assert!(
            src.contains(&format!("__global__ void {name}(")),
            "{name}.cu has no kernel named {name}"
        );
    }
}

#[test]
fn the_gemv_launch_matches_its_kernel() {
    let src = include_str!("../kernels/linear_q4.cu");
    let constant = |name: &str| -> usize {
        let decl = format!("constexpr unsigned int {name} = ");
        let at = src
            .find(&decl)
            .unwrap_or_else(|| panic!("linear_q4.cu has no {name}"))
            + decl.len();
        let digits: String = src[at..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        digits
            .parse()
            .unwrap_or_else(|_| panic!("{name} is not a number"))
    };
    let (threads, cols) = (constant("LQ4_THREADS"), constant("LQ4_COLS"));
    assert_eq!(threads, nibble_cuda::LINEAR_Q4_THREADS as usize);
    assert_eq!(threads / 32 * cols, nibble_cuda::LINEAR_Q4_COLS_PER_BLOCK);
}
