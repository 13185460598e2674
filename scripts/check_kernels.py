#!/usr/bin/env python3
"""Compiles every backend-cuda/kernels/*.cu with NVRTC (from the pinned PyPI wheels) to PTX for
compute_90 and to an sm_90 cubin, prints registers and spill bytes per kernel, and fails on a
compile error, a PTX version other than 9.0, or any spill. Usage: check_kernels.py NVRTC_DIR KERNEL_DIR"""
import ctypes
import pathlib
import re
import sys

nv = pathlib.Path(sys.argv[1])
kernels = sorted(pathlib.Path(sys.argv[2]).glob("*.cu"))
lib_dir = nv / "nvidia" / "cu13" / "lib"
# NVRTC dlopens its builtins by name: load them first so that the name resolves.
for builtins in lib_dir.glob("libnvrtc-builtins.so*"):
    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
nvrtc = ctypes.CDLL(str(next(lib_dir.glob("libnvrtc.so.13*"))))


def check(rc, what):
    if rc != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(rc).decode()}")


def compile_one(src, name, opts):
    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None), "create")
    args = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), args)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    return prog, rc, log.value.decode(errors="replace")


failures = []
print(f"{'kernel':<22} {'ptx':<6} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'smem':>7}")
for path in kernels:
    src = path.read_bytes()
    # The options the backend compiles with: no include path (no kernel needs a header, so
    # nothing has to be found on the GPU machine at run time).
    base = ["--std=c++17"]
    prog, rc, log = compile_one(src, path.name, base + ["--gpu-architecture=compute_90"])
    if rc != 0:
        failures.append(f"{path.name}: compile error\n{log}")
        continue
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "ptx size")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx), "ptx")
    ptx = ptx.value.decode()
    version = re.search(r"^\.version (\S+)", ptx, re.M)
    version = version.group(1) if version else "?"
    if version != "9.0":
        failures.append(f"{path.name}: PTX .version {version}, expected 9.0 (driver 580 JITs 9.0)")
    prog, rc, log = compile_one(src, path.name, base + ["--gpu-architecture=sm_90", "--ptxas-options=-v"])
    if rc != 0:
        failures.append(f"{path.name}: sm_90 compile error\n{log}")
        continue
    check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
    if size.value == 0:
        failures.append(f"{path.name}: empty cubin")
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = re.findall(r"(\d+) bytes smem", log)
    st = sum(int(a) for a, _ in spills)
    ld = sum(int(b) for _, b in spills)
    print(f"{path.stem:<22} {version:<6} {max(map(int, regs or ['0'])):>5} {st:>9} {ld:>9} {max(map(int, smem or ['0'])):>7}")
    if not regs:
        failures.append(f"{path.name}: ptxas printed no resource usage\n{log}")
    if st or ld:
        failures.append(f"{path.name}: {st} bytes spill stores, {ld} bytes spill loads\n{log}")

print(f"{len(kernels)} kernels, {len(failures)} failures")
if failures:
    print("\n".join(failures))
    sys.exit(1)
