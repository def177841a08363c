#!/usr/bin/env python3
"""Build core/cuda/fatbin/flashdecode.fatbin with CUDA 12 compilers from PyPI, so that the
kernels load on CUDA 12 drivers (FD_CUDA=12; docs/tuning.md, "CUDA 12 build", says which
driver and what it costs).

    python3 python/build_backend/fd_cuda12.py [--tools DIR] [--jobs N] [--out FILE]

PyPI has no CUDA 12 nvcc (nvidia-cuda-nvcc-cu12 holds ptxas and libnvvm, not nvcc or cicc), so
this runs nvcc's device pipeline from its parts, pinned in CU12_WHEELS:
  1. NVRTC compiles kernels/flashdecode.cu to PTX for each virtual architecture that ARCHS'
     SASS comes from (sass_source) and PTX_ARCH, with the CUDA 12 headers of
     nvidia-cuda-runtime-cu12 and the kernel list `go generate` writes (fatbin/_instances.inc,
     which must exist: fd_gobuild runs gen_instances first);
  2. ptxas turns the PTX into SASS for each of ARCHS (-warn-spills; -v, whose register and
     spill counts are logged);
  3. nvFatbin packs the cubins and PTX_ARCH's PTX into one fatbin, as nvcc 12 does (PTX
     compressed with the default mode that every CUDA 12 driver reads).
Two differences from nvcc's front end, both about NVRTC only: -default-device (NVRTC treats
an unannotated lambda in device code as host code) and a stdint.h given in memory (NVRTC
ships none; LP64 types, as glibc's).

Tools come from --tools or FD_CUDA12_TOOLS (a `pip install --target` folder, see
dev/cuda12-tools.txt), else sys.path (fd_backend installs CU12_WHEELS into the isolated build
environment). Each is checked to be the pinned release. --jobs (or FD_CUDA12_JOBS) runs that
many compiles (NVRTC, then ptxas) at once, a process each (default: one per CPU; the fatbin is
the same).
"""
import argparse
import concurrent.futures
import ctypes
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FATBIN_DIR = os.path.join(ROOT, "core", "cuda", "fatbin")
SOURCE = os.path.join(ROOT, "kernels", "flashdecode.cu")
# The release whose NVRTC, ptxas, headers and nvFatbin build the kernels, and its wheels.
CU12_RELEASE = "12.8"
CU12_WHEELS = ["nvidia-cuda-nvrtc-cu12==12.8.93", "nvidia-cuda-nvcc-cu12==12.8.93",
               "nvidia-cuda-runtime-cu12==12.8.90", "nvidia-nvfatbin-cu12==12.8.90"]
# SASS for each of ARCHS, compiled from the PTX of its own architecture or of SASS_FROM's
# (sm_100 and sm_120: compute_90's, which spills less there than NVRTC's compute_100/120 PTX,
# docs/tuning.md), and PTX for PTX_ARCH, which GPUs without SASS here JIT: gen.go's nvcc line.
# compute_90, not the newest: the kernels use nothing newer, and its PTX JITs on every GPU
# from sm_90 up, where compute_120's would not on sm_110 (which has no SASS here).
ARCHS = ["80", "86", "89", "90", "100", "120"]
SASS_FROM = {"100": "90", "120": "90"}
PTX_ARCH = "90"
# Where each tool lies inside the wheels' nvidia/ folder.
NVRTC_LIB = ("cuda_nvrtc", "lib", "libnvrtc.so.12")
PTXAS = ("cuda_nvcc", "bin", "ptxas")
HEADERS = ("cuda_runtime", "include")
NVFATBIN = ("nvfatbin", "lib", "libnvfatbin.so.12")
STDINT_H = b"""/* stdint.h for NVRTC, which ships none (fd_cuda12.py): LP64, as glibc's. */
#pragma once
typedef signed char int8_t; typedef unsigned char uint8_t;
typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t;
typedef long int64_t; typedef unsigned long uint64_t;
typedef long intptr_t; typedef unsigned long uintptr_t;
"""


def log(msg):
    print(f"flash-decode build (CUDA {CU12_RELEASE}): {msg}", file=sys.stderr, flush=True)


def find_tools(tools_dir=None):
    """Return {name: path} of NVRTC, ptxas, the headers and nvFatbin: under tools_dir/nvidia,
    else the first nvidia/ folder on sys.path that holds each; raise naming what is missing."""
    tools_dir = tools_dir or os.environ.get("FD_CUDA12_TOOLS")
    roots = [tools_dir] if tools_dir else [p for p in sys.path if p and os.path.isdir(p)]
    found, missing = {}, []
    for name, parts in (("nvrtc", NVRTC_LIB), ("ptxas", PTXAS), ("headers", HEADERS), ("nvfatbin", NVFATBIN)):
        path = next((os.path.join(r, "nvidia", *parts) for r in roots
                     if os.path.exists(os.path.join(r, "nvidia", *parts))), None)
        if path:
            found[name] = path
        else:
            missing.append(os.path.join("nvidia", *parts))
    if missing:
        raise RuntimeError(f"no {', '.join(missing)} in {tools_dir or 'sys.path'}: `pip install "
                           f"--target DIR " + " ".join(CU12_WHEELS) + "` and set FD_CUDA12_TOOLS=DIR")
    return found


class NVRTC:
    """The few NVRTC calls that compile one source to PTX."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"

    def check(self, code, what):
        if code:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(code).decode()}")

    def ptx(self, source, name, options, headers):
        """Return (PTX with its terminating NUL, compile log) of source; raise with the log."""
        prog = ctypes.c_void_p()
        names, texts = list(headers), [headers[n] for n in headers]
        self.check(self.lib.nvrtcCreateProgram(
            ctypes.byref(prog), source, name.encode(), len(names),
            (ctypes.c_char_p * len(texts))(*texts), (ctypes.c_char_p * len(names))(*[n.encode() for n in names])),
            "nvrtcCreateProgram")
        try:
            opts = [o.encode() for o in options]
            code = self.lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            size = ctypes.c_size_t()
            self.check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value)
            self.check(self.lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            compile_log = buf.value.decode(errors="replace")
            if code:
                raise RuntimeError(f"NVRTC {self.version} could not compile {name} "
                                   f"({' '.join(options)}):\n{compile_log}")
            self.check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            buf = ctypes.create_string_buffer(size.value)
            self.check(self.lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            return buf.raw, compile_log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def pack(nvfatbin_path, cubins, ptx):
    """Return a fatbin of cubins {arch: bytes} and ptx (arch, bytes), packed by nvFatbin with
    nvcc's defaults (64-bit entries, Linux host, PTX compressed in the default mode)."""
    lib = ctypes.CDLL(nvfatbin_path)
    lib.nvFatbinGetErrorString.restype = ctypes.c_char_p

    def check(code, what):
        if code:
            raise RuntimeError(f"{what}: {lib.nvFatbinGetErrorString(code).decode()}")

    handle = ctypes.c_void_p()
    opts = [b"-64", b"-host=linux"]
    check(lib.nvFatbinCreate(ctypes.byref(handle), (ctypes.c_char_p * len(opts))(*opts), len(opts)), "nvFatbinCreate")
    try:
        for arch, cubin in cubins.items():
            check(lib.nvFatbinAddCubin(handle, cubin, len(cubin), arch.encode(), b"flashdecode"),
                  f"nvFatbinAddCubin sm_{arch}")
        arch, text = ptx
        check(lib.nvFatbinAddPTX(handle, text, len(text), arch.encode(), b"flashdecode", b""),
              f"nvFatbinAddPTX compute_{arch}")
        size = ctypes.c_size_t()
        check(lib.nvFatbinSize(handle, ctypes.byref(size)), "nvFatbinSize")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvFatbinGet(handle, buf), "nvFatbinGet")
        return buf.raw
    finally:
        lib.nvFatbinDestroy(ctypes.byref(handle))


def ptxas_version(ptxas):
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else out.strip()


def spills(ptxas_log):
    """{kernel: (spill store bytes, spill load bytes)} of the kernels ptxas -v says spill."""
    out, kernel = {}, None
    for line in ptxas_log.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            kernel = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and kernel and (m.group(1) != "0" or m.group(2) != "0"):
            out[kernel] = (int(m.group(1)), int(m.group(2)))
    return out


def listed_kernels(include_dir):
    """The kernel names of the kernel list (_instances.inc: a FD_<FORM>(name, ...) line each;
    the combines' balanced twins, name_bal, come from the same line)."""
    with open(os.path.join(include_dir, "_instances.inc")) as f:
        lines = re.findall(r"^(FD_\w+)\((\w+),", f.read(), re.M)
    names = [name for _, name in lines]
    return names + [name + "_bal" for form, name in lines if form.startswith("FD_COMBINE")]


def missing_kernels(cubin, names):
    """The names of names whose code (an ELF section .text.<name>) the cubin lacks."""
    return [n for n in names if b".text." + n.encode() + b"\0" not in cubin]


def sass_source(arch):
    """The virtual architecture whose PTX sm_<arch>'s SASS is compiled from."""
    return SASS_FROM.get(arch, arch)


def compile_ptx(tools, arch, include_dir, scratch):
    """Return (arch, PTX) of the kernels for compute_<arch>, also written into scratch."""
    nvrtc = NVRTC(tools["nvrtc"])
    with open(SOURCE, "rb") as f:
        source = f.read()
    options = [f"--gpu-architecture=compute_{arch}", "-std=c++17", "-default-device",
               f"-I{os.path.dirname(SOURCE)}", f"-I{include_dir}", f"-I{tools['headers']}"]
    ptx, _ = nvrtc.ptx(source, os.path.basename(SOURCE), options, {"stdint.h": STDINT_H})
    with open(os.path.join(scratch, f"flashdecode.compute_{arch}.ptx"), "wb") as f:
        f.write(ptx.rstrip(b"\0"))
    return arch, ptx


def compile_sass(tools, arch, include_dir, scratch):
    """Return (arch, cubin) of the kernels for sm_<arch>, from the PTX of sass_source(arch)
    that compile_ptx wrote, logging spills."""
    t0 = time.monotonic()
    ptx_file = os.path.join(scratch, f"flashdecode.compute_{sass_source(arch)}.ptx")
    cubin_file = os.path.join(scratch, f"flashdecode.sm_{arch}.cubin")
    res = subprocess.run([tools["ptxas"], f"-arch=sm_{arch}", "-m64", "-O3", "-warn-spills", "-v",
                          ptx_file, "-o", cubin_file], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas sm_{arch} failed:\n{res.stdout}{res.stderr}")
    with open(cubin_file, "rb") as f:
        cubin = f.read()
    missing = missing_kernels(cubin, listed_kernels(include_dir))
    if missing:
        raise RuntimeError(f"sm_{arch}: no code for {', '.join(missing)}")
    spilled = spills(res.stdout + res.stderr)
    kernels = len(re.findall(r"Compiling entry function", res.stdout + res.stderr))
    log(f"sm_{arch} (from compute_{sass_source(arch)}): {kernels} kernels in {time.monotonic() - t0:.0f} s, "
        + (f"{len(spilled)} spill: " + ", ".join(f"{k} ({s}/{l} bytes stored/loaded)"
                                                  for k, (s, l) in sorted(spilled.items()))
           if spilled else "no spills"))
    return arch, cubin


def run_all(fn, args, jobs):
    """fn over args, jobs processes at once (1: in this process)."""
    if jobs == 1:
        return [fn(*a) for a in args]
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(fn, *zip(*args)))


def build(out, include_dir=FATBIN_DIR, tools_dir=None, jobs=None, scratch=None):
    """Compile the kernels for ARCHS and write the fatbin to out."""
    tools = find_tools(tools_dir)
    nvrtc = NVRTC(tools["nvrtc"])
    have = {"NVRTC": nvrtc.version, "ptxas": ptxas_version(tools["ptxas"])}
    wrong = {k: v for k, v in have.items() if v != CU12_RELEASE}
    if wrong:
        raise RuntimeError(f"{wrong} is not the pinned CUDA {CU12_RELEASE} ({' '.join(CU12_WHEELS)})")
    if not os.path.isfile(os.path.join(include_dir, "_instances.inc")):
        raise RuntimeError(f"no _instances.inc in {include_dir}: run "
                           "`go generate -run gen_instances ./core/cuda` first")
    jobs = jobs or int(os.environ.get("FD_CUDA12_JOBS") or 0) or os.cpu_count()
    scratch = scratch or os.path.join(ROOT, "_build", "cuda12")
    os.makedirs(scratch, exist_ok=True)
    log(f"NVRTC, ptxas {have['ptxas']} from {tools['nvrtc'].rsplit(os.sep + 'nvidia' + os.sep, 1)[0]}; "
        f"sm_{', sm_'.join(ARCHS)}, {jobs} at once")
    t0 = time.monotonic()
    ptx_archs = sorted({sass_source(a) for a in ARCHS} | {PTX_ARCH}, key=int)
    ptx = dict(run_all(compile_ptx, [(tools, a, include_dir, scratch) for a in ptx_archs], jobs))
    log(f"PTX for compute_{', compute_'.join(ptx_archs)} in {time.monotonic() - t0:.0f} s")
    cubins = dict(run_all(compile_sass, [(tools, a, include_dir, scratch) for a in ARCHS], jobs))
    fatbin = pack(tools["nvfatbin"], cubins, (PTX_ARCH, ptx[PTX_ARCH]))
    with open(out, "wb") as f:
        f.write(fatbin)
    log(f"wrote {out} ({len(fatbin) / 1e6:.1f} MB)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", help="folder the CUDA 12 wheels were pip-installed into (--target)")
    ap.add_argument("--jobs", type=int, help="architectures compiled at once (default: CPUs)")
    ap.add_argument("--out", default=os.path.join(FATBIN_DIR, "flashdecode.fatbin"))
    args = ap.parse_args()
    try:
        build(args.out, tools_dir=args.tools, jobs=args.jobs)
    except RuntimeError as e:
        sys.exit(f"fd_cuda12: {e}")


if __name__ == "__main__":
    main()
