//! Positional reads of a local file, portable: `pread` on Unix, `seek_read` on Windows. The GGUF
//! reader and io's file source use them.

use std::fs::File;

/// One positional read: `pread` on Unix, `ReadFile` at an offset on Windows (which moves the
/// file cursor; nibble never reads these handles any other way).
#[cfg(unix)]
fn read_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    f.read_at(buf, offset)
}

#[cfg(windows)]
fn read_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::windows::fs::FileExt;
    f.seek_read(buf, offset)
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
pub fn pread_full(f: &File, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match read_at(f, &mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
