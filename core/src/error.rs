//! The one error type of `nibble-core`: every variant names the file, and where it applies the
//! tensor and the byte offset, so that a user can find the broken byte with a hex editor.

use std::fmt;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What is wrong with a bitsandbytes 4-bit weight's quantization state.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantProblem {
    /// A state-dict key the format requires is absent (e.g. `absmax`).
    MissingComponent(&'static str),
    /// `nested_absmax` without `nested_quant_map`, or the other way round, or a nested JSON
    /// without nested tensors.
    InconsistentNesting(String),
    /// The quant-state blob is not the JSON object bitsandbytes writes.
    BadJson(String),
    /// `quant_type` is neither `nf4` nor `fp4`, or disagrees with the key suffix.
    UnknownQuantType(String),
    /// A blocksize that is not a power of two in the allowed range.
    BadBlocksize { field: &'static str, value: u64 },
    /// The recorded dtype is not float32 / float16 / bfloat16.
    UnknownDtype(String),
    /// The logical shape's element count overflows u64.
    ShapeOverflow,
    /// A component has the wrong dtype.
    WrongDtype {
        component: &'static str,
        expected: &'static str,
        actual: String,
    },
    /// A component has the wrong number of elements.
    WrongCount {
        component: &'static str,
        expected: u64,
        actual: u64,
    },
}

impl fmt::Display for QuantProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantProblem::MissingComponent(c) => write!(f, "missing component '{c}'"),
            QuantProblem::InconsistentNesting(m) => {
                write!(f, "inconsistent double quantization: {m}")
            }
            QuantProblem::BadJson(m) => write!(f, "quant_state JSON: {m}"),
            QuantProblem::UnknownQuantType(t) => {
                write!(f, "unknown quant_type '{t}' (expected nf4 or fp4)")
            }
            QuantProblem::BadBlocksize { field, value } => write!(
                f,
                "{field} {value} is not a power of two between 32 and 4096"
            ),
            QuantProblem::UnknownDtype(d) => {
                write!(
                    f,
                    "unknown dtype '{d}' (expected float32, float16 or bfloat16)"
                )
            }
            QuantProblem::ShapeOverflow => write!(f, "logical shape's element count overflows"),
            QuantProblem::WrongDtype {
                component,
                expected,
                actual,
            } => {
                write!(f, "{component} has dtype {actual}, expected {expected}")
            }
            QuantProblem::WrongCount {
                component,
                expected,
                actual,
            } => {
                write!(f, "{component} has {actual} elements, expected {expected}")
            }
        }
    }
}

/// Every failure `nibble-core` reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system I/O failure.
    #[error("{path}: {source}")]
    Io {
        /// The file or URL.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is shorter than the 8-byte header length.
    #[error("{file}: file is {len} bytes, too short for a safetensors header (at least 8 bytes)")]
    FileTooShort {
        /// The file.
        file: String,
        /// Its length.
        len: u64,
    },
    /// The header length field points past the end of the file.
    #[error("{file}: header length {header_len} at offset 0 runs past the end of the file ({file_len} bytes)")]
    HeaderPastEof {
        /// The file.
        file: String,
        /// The u64 read at offset 0.
        header_len: u64,
        /// The file's length.
        file_len: u64,
    },
    /// The header is larger than any real file's header.
    #[error("{file}: header length {header_len} exceeds the limit of {limit} bytes")]
    HeaderTooLarge {
        /// The file.
        file: String,
        /// The u64 read at offset 0.
        header_len: u64,
        /// The limit.
        limit: u64,
    },
    /// The header bytes at offset 8 are not a JSON object of the safetensors form.
    #[error("{file}: header at offset 8 is not valid safetensors JSON: {msg}")]
    HeaderJson {
        /// The file.
        file: String,
        /// What the parser said.
        msg: String,
    },
    /// A tensor entry in the header is malformed (unknown dtype, missing field, reversed offsets).
    #[error("{file}: tensor '{tensor}': {msg}")]
    BadTensorEntry {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        msg: String,
    },
    /// The tensor's shape product (or its byte size) overflows.
    #[error("{file}: tensor '{tensor}': shape {shape:?} overflows")]
    ShapeOverflow {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// The shape as written.
        shape: Vec<u64>,
    },
    /// The byte range does not match shape x dtype size.
    #[error("{file}: tensor '{tensor}' at offset {offset}: {actual} bytes, but shape x dtype needs {expected}")]
    ByteLengthMismatch {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// Absolute offset of the tensor's data in the file.
        offset: u64,
        /// Bytes required by shape and dtype.
        expected: u64,
        /// Bytes given by data_offsets.
        actual: u64,
    },
    /// The tensor's data runs past the end of the file.
    #[error("{file}: tensor '{tensor}' at offset {offset}: data ends at {end}, past the end of the file ({file_len} bytes)")]
    OffsetOutOfRange {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// Absolute start offset.
        offset: u64,
        /// Absolute end offset.
        end: u64,
        /// The file's length.
        file_len: u64,
    },
    /// Two tensors share bytes.
    #[error("{file}: tensor '{tensor}' at offset {offset} overlaps tensor '{other}' (which ends at {other_end})")]
    OffsetOverlap {
        /// The file.
        file: String,
        /// The later tensor.
        tensor: String,
        /// Its absolute start offset.
        offset: u64,
        /// The earlier tensor.
        other: String,
        /// Absolute end of the earlier tensor.
        other_end: u64,
    },
    /// Bytes of the data buffer that no tensor covers.
    #[error("{file}: {len} unused bytes at offset {offset} (before tensor '{tensor}')")]
    OffsetGap {
        /// The file.
        file: String,
        /// The tensor after the gap, or `<end of file>`.
        tensor: String,
        /// Absolute offset where the gap starts.
        offset: u64,
        /// Length of the gap.
        len: u64,
    },
    /// A read returned fewer bytes than the index promised (file truncated while open, say).
    #[error("{file}: tensor '{tensor}' at offset {offset}: short read, wanted {wanted} bytes, got {got}")]
    ShortRead {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// Absolute offset of the read.
        offset: u64,
        /// Bytes asked for.
        wanted: u64,
        /// Bytes received.
        got: u64,
    },
    /// A model folder or shard index is malformed.
    #[error("{file}: {msg}")]
    Model {
        /// The folder, index JSON or config file.
        file: String,
        /// What is wrong.
        msg: String,
    },
    /// A tensor that was asked for does not exist.
    #[error("{file}: no tensor named '{tensor}'")]
    NoSuchTensor {
        /// The file or model folder.
        file: String,
        /// The name asked for.
        tensor: String,
    },
    /// A tensor has a dtype the operation cannot use.
    #[error("{file}: tensor '{tensor}' has dtype {actual}, expected {expected}")]
    WrongDtype {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// What was wanted.
        expected: String,
        /// What it is.
        actual: String,
    },
    /// A bitsandbytes 4-bit weight whose quantization state is malformed.
    #[error("{file}: 4-bit weight '{tensor}': {problem}")]
    Quant {
        /// The file.
        file: String,
        /// The weight's base name (e.g. `model.layers.0.mlp.up_proj.weight`).
        tensor: String,
        /// What is wrong.
        problem: QuantProblem,
    },
    /// Invalid arguments to an operation (shapes that do not fit, bad options).
    #[error("{0}")]
    Invalid(String),
    /// A weight or a result that is NaN or infinite: the model's file or constants produce
    /// garbage, and anything printed from it would look plausible.
    #[error("{what}: element {index} is {value}, not a finite number")]
    NonFinite {
        /// The tensor, and where in the run (step, position).
        what: String,
        /// The first element that is not finite.
        index: usize,
        /// Its value.
        value: f32,
    },
}

/// `Ok` when every value is finite, else [`Error::NonFinite`] for the first one that is not;
/// `what` names the tensor and the step (built only on error).
pub fn check_finite(values: &[f32], what: impl FnOnce() -> String) -> Result<()> {
    // A sum of `x * 0` is NaN exactly when some `x` is NaN or infinite: one vectorisable pass.
    let any_bad = values
        .chunks(4096)
        .any(|c| c.iter().fold(0f32, |a, &x| a + x * 0.0) != 0.0);
    if !any_bad {
        return Ok(());
    }
    match values.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: what(),
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

thread_local! {
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside a call behind the panic boundary ([`guarded`]): a panic hook
/// can stay quiet then (the panic becomes an error that is reported in its place).
pub fn in_guarded_call() -> bool {
    GUARDED.with(|g| g.get())
}

/// Runs `f`, a call into a third-party parser (`library`, e.g. "the tokenizer library") on
/// `file`, behind a panic boundary: its error or its panic becomes an [`Error::Model`] naming
/// the file. A parser's panic on a malformed file must not end the process.
pub fn guarded<T, E: fmt::Display>(
    file: &str,
    library: &str,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> Result<T> {
    let was = GUARDED.with(|g| g.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    match r {
        Ok(r) => r.map_err(|e| Error::Model {
            file: file.into(),
            msg: e.to_string(),
        }),
        Err(p) => {
            let why = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(Error::Model {
                file: file.into(),
                msg: format!("{library} failed on this file (it panicked: {why})"),
            })
        }
    }
}

/// `n` zeroed values, or an error naming `what` when the allocation is refused (a planned
/// allocation must not abort the process: an address-space limit or overcommit policy can
/// refuse what the budget allowed).
pub fn zeroed<T: Clone + Default>(n: usize, what: &str) -> Result<Vec<T>> {
    zeroed_advised(n, what, false)
}

/// [`zeroed`] on transparent huge pages where Linux grants them (`madvise` mode, the common
/// default, gives them only to ranges that ask): for memory that kernels stream through every
/// pass (the CPU backend's weight pool and arena), where 4 KiB pages make each page a TLB miss.
pub fn zeroed_huge<T: Clone + Default>(n: usize, what: &str) -> Result<Vec<T>> {
    zeroed_advised(n, what, true)
}

fn zeroed_advised<T: Clone + Default>(n: usize, what: &str, huge: bool) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::Invalid(format!(
            "{what}: the allocation of {} bytes was refused",
            n as u128 * std::mem::size_of::<T>() as u128
        ))
    })?;
    #[cfg(all(target_os = "linux", feature = "native"))]
    if huge {
        // The whole 2 MiB pages inside the allocation, before anything touches them.
        const PAGE: usize = 2 << 20;
        let start = v.as_ptr() as usize;
        let end = start + v.capacity() * std::mem::size_of::<T>();
        let (a, b) = (start.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
        if b > a {
            // SAFETY: advice on whole pages of this allocation; it changes no contents.
            unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(all(target_os = "linux", feature = "native")))]
    let _ = huge;
    v.resize(n, T::default());
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_planned_allocation_is_an_error_naming_it() {
        // 1 PiB: more than any allocator here grants, so `try_reserve` is refused, not the
        // process aborted.
        let e = zeroed::<u8>(1 << 50, "the test's arena").expect_err("1 PiB");
        assert!(e.to_string().contains("the test's arena"), "{e}");
        assert!(e.to_string().contains("refused"), "{e}");
        let v = zeroed::<f32>(1000, "a small one").expect("1000 floats");
        assert!(v.len() == 1000 && v.iter().all(|&x| x == 0.0));
    }
}
