#!/usr/bin/env python3
"""Build a stand-in libcuda.so.1 for machines without an NVIDIA driver.

    python3 python/build_backend/make_libcuda.py --cuda-h $CUDA_HOME/include/cuda.h --out DIR

writes DIR/libcuda.so.1 (soname libcuda.so.1) and DIR/libcuda.so -> libcuda.so.1.

It exports every CUresult-returning driver function that cuda.h declares (found by running
`gcc -E` over it three times: plain, with the legacy pre-versioned names of
__CUDA_API_VERSION_INTERNAL, and with the per-thread-stream _ptsz/_ptds names). Behaviour:

- cuInit returns CUDA_SUCCESS (0), so gorgonia.org/cu's package init does not os.Exit;
  in the copy this command builds (not the wheel's), the environment variable
  FAKECUDA_CUINIT=<code> makes it return <code> instead (to test an unusable driver);
- cuDriverGetVersion reports 13000 (--driver-version), cuDeviceGetCount reports 0 devices;
- cuGetErrorString / cuGetErrorName return the CUresult's name (from cuda.h's enum) or a
  short description;
- cuGetProcAddress(_v2) hands out these functions by name (any other name gets one that
  returns CUDA_ERROR_NO_DEVICE), so the CUDA runtime, e.g. torch's, finds a driver without
  a device, as it would on a machine whose GPUs are hidden, instead of failing to start;
- every other function returns CUDA_ERROR_NO_DEVICE (100) and writes nothing.

Uses: (a) the link-time libcuda.so when the machine has no real one (like CUDA's lib64/stubs);
(b) LD_LIBRARY_PATH=DIR in CI, so Go code linking gorgonia.org/cu (the capi library, the gopy
extension, `go test ./core/cuda`) loads and reports "no device" instead of exiting;
(c) in the wheel, as flash_decode/_binding/libcuda_standin.so (fd_gobuild.py), which
flash_decode._native loads only where no libcuda.so.1 can be loaded, so that the pure-Go
planner works without a driver.
Never install it where a real driver would be found.

With --fake-device (CI's copy for the launch test, never the wheel's) it reports one sm_90
device of 132 SMs instead, whose kernels do nothing: module loads, function lookups,
occupancy and cluster queries answer, memory is host memory, and each kernel launch is
appended to the file the environment variable FAKECUDA_LAUNCH_LOG names, for
core/cuda's TestLaunchesFollowThePlan.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

# Defines under which cuda.h declares extra exported names.
_VARIANTS = ([], ["-D__CUDA_API_VERSION_INTERNAL"], ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"])
_FUNC = re.compile(r"\bCUresult\s+(cu\w+)\s*\(")
_ENUM = re.compile(r"\b(CUDA_(?:SUCCESS|ERROR_\w+))\s*=\s*(\d+)")
_DESCRIPTIONS = {
    0: "no error",
    3: "initialization error",
    100: "no CUDA-capable device is detected (a stand-in libcuda.so.1, not an NVIDIA driver)",
}
_SPECIAL = {
    "cuInit": """
int cuInit(unsigned int flags) {
    (void)flags;
#ifdef FAKECUDA_CUINIT_ENV
    const char *s = getenv(FAKECUDA_CUINIT_ENV);
    return s ? atoi(s) : 0;
#else
    return 0;
#endif
}""",
    "cuDriverGetVersion": """
int cuDriverGetVersion(int *v) {
    if (!v) return 1;
    *v = FAKECUDA_DRIVER_VERSION;
    return 0;
}""",
    "cuDeviceGetCount": """
int cuDeviceGetCount(int *n) {
    if (!n) return 1;
    *n = 0;
    return 0;
}""",
    "cuGetErrorString": """
int cuGetErrorString(int e, const char **s) {
    if (!s) return 1;
    *s = fakecuda_describe(e);
    return 0;
}""",
    "cuGetErrorName": """
int cuGetErrorName(int e, const char **s) {
    if (!s) return 1;
    *s = fakecuda_name(e);
    return 0;
}""",
    "cuGetProcAddress": """
int cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    (void)version; (void)flags;
    if (!symbol || !pfn) return 1;
    *pfn = fakecuda_proc(symbol);
    return 0;
}""",
    "cuGetProcAddress_v2": """
int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                        int *status) {
    (void)version; (void)flags;
    if (!symbol || !pfn) return 1;
    *pfn = fakecuda_proc(symbol);
    if (status) *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
    return 0;
}""",
}
# With fake_device (tests only, never the wheel's copy): one device, an sm_90 part of 132 SMs
# (FAKECUDA_CC_MAJOR, read at each query, sets another major version, and
# FAKECUDA_SHARED_OPTIN a smaller shared memory a block),
# whose kernels do nothing. Enough driver for core/cuda to open it, load the module, plan and
# launch: each launch is appended as a line to the file FAKECUDA_LAUNCH_LOG names (kernel
# name, grid, block, shared bytes, cluster x, programmatic serialization), for tests of what
# the Go core launches. Memory is host memory; copies and sets are memcpy and memset.
_FAKE_DEVICE_PRELUDE = """
#include <stdio.h>
typedef struct { unsigned int x, y, z; } fk_dim;
typedef struct { unsigned int id; char pad[4]; union { char raw[64]; fk_dim cluster; int pdl; } value; } fk_attr;
typedef struct {
    unsigned int gx, gy, gz, bx, by, bz, smem;
    void *stream;
    fk_attr *attrs;
    unsigned int num_attrs;
} fk_config;
typedef struct { char name[256]; } fk_function;
static __thread void *fk_current;
static char fk_primary;  /* the primary context's handle is its address */
static char fk_module;
"""
_FAKE_DEVICE = {
    "cuDeviceGetCount": "int cuDeviceGetCount(int *n) { if (!n) return 1; *n = 1; return 0; }",
    "cuDeviceGet": "int cuDeviceGet(int *d, int i) { if (!d || i != 0) return 101; *d = 0; return 0; }",
    "cuDeviceGetAttribute": """
int cuDeviceGetAttribute(int *v, int attr, int dev) {
    if (!v || dev != 0) return 101;
    switch (attr) {
    case 16: *v = 132; break;             /* MULTIPROCESSOR_COUNT */
    case 75: {                            /* COMPUTE_CAPABILITY_MAJOR: FAKECUDA_CC_MAJOR, else 9 */
        const char *m = getenv("FAKECUDA_CC_MAJOR");
        *v = m ? atoi(m) : 9;
        break;
    }
    case 76: *v = 0; break;               /* COMPUTE_CAPABILITY_MINOR */
    case 1: *v = 1024; break;             /* MAX_THREADS_PER_BLOCK */
    case 10: *v = 32; break;              /* WARP_SIZE */
    case 97: {                            /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: FAKECUDA_SHARED_OPTIN, else 232448 */
        const char *o = getenv("FAKECUDA_SHARED_OPTIN");
        *v = o ? atoi(o) : 232448;
        break;
    }
    case 81: *v = 233472; break;          /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    default: *v = 0;
    }
    return 0;
}""",
    "cuDevicePrimaryCtxRetain": "int cuDevicePrimaryCtxRetain(void **c, int d) { if (!c || d != 0) return 101; *c = &fk_primary; return 0; }",
    "cuDevicePrimaryCtxRelease": "int cuDevicePrimaryCtxRelease(int d) { return d == 0 ? 0 : 101; }",
    "cuDevicePrimaryCtxRelease_v2": "int cuDevicePrimaryCtxRelease_v2(int d) { return d == 0 ? 0 : 101; }",
    "cuCtxGetCurrent": "int cuCtxGetCurrent(void **c) { if (!c) return 1; *c = fk_current; return 0; }",
    "cuCtxSetCurrent": "int cuCtxSetCurrent(void *c) { fk_current = c; return 0; }",
    "cuCtxGetDevice": "int cuCtxGetDevice(int *d) { if (!d) return 1; *d = 0; return 0; }",
    "cuCtxSynchronize": "int cuCtxSynchronize(void) { return 0; }",
    "cuStreamSynchronize": "int cuStreamSynchronize(void *s) { (void)s; return 0; }",
    "cuModuleLoadData": "int cuModuleLoadData(void **m, const void *image) { if (!m || !image) return 1; *m = &fk_module; return 0; }",
    "cuModuleGetFunction": """
int cuModuleGetFunction(void **f, void *m, const char *name) {
    if (!f || m != &fk_module || !name) return 1;
    fk_function *fn = calloc(1, sizeof *fn);
    if (!fn) return 2;
    strncpy(fn->name, name, sizeof fn->name - 1);
    *f = fn;
    return 0;
}""",
    "cuFuncGetModule": "int cuFuncGetModule(void **m, void *f) { if (!m || !f) return 1; *m = &fk_module; return 0; }",
    "cuFuncSetAttribute": """
/* MAX_DYNAMIC_SHARED_SIZE_BYTES past FAKECUDA_SHARED_OPTIN (a smaller GPU's) is refused */
int cuFuncSetAttribute(void *f, int attr, int v) {
    const char *optin = getenv("FAKECUDA_SHARED_OPTIN");
    if (!f) return 400;
    return attr == 8 && optin && v > atoi(optin) ? 1 : 0;
}""",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": """
int cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *f, int threads, size_t smem) {
    if (!n || !f || threads < 1) return 1;
    int by_smem = (int)(233472 / (smem + 1024)), by_threads = 2048 / threads;
    *n = by_smem < by_threads ? by_smem : by_threads;
    return 0;
}""",
    "cuOccupancyMaxActiveClusters": """
int cuOccupancyMaxActiveClusters(int *n, void *f, const fk_config *c) {
    if (!n || !f || !c) return 1;
    unsigned size = 1;
    for (unsigned i = 0; i < c->num_attrs; i++)
        if (c->attrs[i].id == 4) size = c->attrs[i].value.cluster.x;
    /* A cluster runs inside one GPC: 8 GPCs of these sizes hold 132 SMs, and 7 clusters of 16
       blocks at one block an SM, as on an H200. */
    static const int gpc_sms[8] = {18, 18, 17, 17, 16, 16, 16, 14};
    int per_sm = (int)(233472 / (c->smem + 1024)), by_threads = 2048 / (int)(c->bx ? c->bx : 1);
    if (by_threads < per_sm) per_sm = by_threads;
    *n = 0;
    for (int g = 0; g < 8 && size <= 16; g++) *n += gpc_sms[g] * per_sm / (int)size;
    return 0;
}""",
    "cuLaunchKernelEx": """
int cuLaunchKernelEx(const fk_config *c, void *f, void **params, void **extra) {
    (void)params; (void)extra;
    if (!c || !f) return 1;
    unsigned cluster = 1; int pdl = 0;
    for (unsigned i = 0; i < c->num_attrs; i++) {
        if (c->attrs[i].id == 4) cluster = c->attrs[i].value.cluster.x;
        if (c->attrs[i].id == 6) pdl = c->attrs[i].value.pdl;
    }
    const char *log = getenv("FAKECUDA_LAUNCH_LOG");
    if (log) {
        FILE *out = fopen(log, "a");
        if (!out) return 999;
        fprintf(out, "%s %u %u %u %u %u %u %d\\n", ((fk_function *)f)->name, c->gx, c->gy, c->gz, c->bx, c->smem,
                cluster, pdl);
        fclose(out);
    }
    return 0;
}""",
    "cuMemAlloc_v2": """
int cuMemAlloc_v2(unsigned long long *p, size_t n) {
    void *m = NULL;
    if (!p || posix_memalign(&m, 256, n ? n : 1)) return 2;
    *p = (unsigned long long)m;
    return 0;
}""",
    "cuMemFree_v2": "int cuMemFree_v2(unsigned long long p) { free((void *)p); return 0; }",
    "cuMemsetD8_v2": "int cuMemsetD8_v2(unsigned long long p, unsigned char v, size_t n) { memset((void *)p, v, n); return 0; }",
    "cuMemcpyHtoD_v2": "int cuMemcpyHtoD_v2(unsigned long long d, const void *s, size_t n) { memcpy((void *)d, s, n); return 0; }",
    "cuMemcpyDtoH_v2": "int cuMemcpyDtoH_v2(void *d, unsigned long long s, size_t n) { memcpy(d, (void *)s, n); return 0; }",
}

# Emitted only where cuda.h declares them (cuGetProcAddress_v2: CUDA 12 and newer).
_OPTIONAL = {"cuGetProcAddress", "cuGetProcAddress_v2"}


def preprocess(cuda_h, cc, defines):
    """Return cuda.h after the C preprocessor, with the given -D flags."""
    cmd = [cc, "-E", "-P", "-x", "c", *defines, cuda_h]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def scan(cuda_h, cc):
    """Return (sorted driver function names, {error code: enum name}) declared by cuda.h."""
    names, codes = set(), {}
    for defines in _VARIANTS:
        text = preprocess(cuda_h, cc, defines)
        names.update(_FUNC.findall(text))
        for name, code in _ENUM.findall(text):
            codes.setdefault(int(code), name)
    missing = set(_SPECIAL) - _OPTIONAL - names
    if missing:
        sys.exit(f"make_libcuda: {cuda_h} does not declare {sorted(missing)}")
    return sorted(names), codes


def c_source(names, codes, driver_version, cuinit_env=None, fake_device=False):
    """Return the C source of the stand-in library (cuinit_env, fake_device: see build)."""
    special = dict(_SPECIAL, **(_FAKE_DEVICE if fake_device else {}))
    out = [
        "/* Generated by python/build_backend/make_libcuda.py: a stand-in libcuda.so.1. Do not edit. */",
        "#include <stdlib.h>",
        "#include <string.h>",
        f"#define FAKECUDA_DRIVER_VERSION {driver_version}",
    ]
    if fake_device:
        out.append(_FAKE_DEVICE_PRELUDE)
    if cuinit_env:
        out.append(f'#define FAKECUDA_CUINIT_ENV "{cuinit_env}"')
    out += [
        "static const char *fakecuda_name(int e) {",
        "    switch (e) {",
    ]
    out += [f'    case {c}: return "{n}";' for c, n in sorted(codes.items())]
    out += ['    default: return "CUDA_ERROR_UNKNOWN";', "    }", "}"]
    out += ["static const char *fakecuda_describe(int e) {", "    switch (e) {"]
    out += [f'    case {c}: return "{d}";' for c, d in sorted(_DESCRIPTIONS.items())]
    out += ["    default: return fakecuda_name(e);", "    }", "}"]
    out.append("static void *fakecuda_proc(const char *symbol);")
    for name in names:
        # Arguments are ignored; on the C ABIs we target, a callee declared with fewer
        # parameters than the caller passes is harmless. 100 = CUDA_ERROR_NO_DEVICE.
        out.append(special.get(name, f"int {name}(void) {{ return 100; }}"))
    # What cuGetProcAddress hands out: the special functions by name, else one that
    # returns CUDA_ERROR_NO_DEVICE; cuGetProcAddress's own name gets its newest form.
    specials = [n for n in sorted(special) if n in names]
    newest = "cuGetProcAddress_v2" if "cuGetProcAddress_v2" in names else "cuGetProcAddress"
    out += ["static int fakecuda_no_device(void) { return 100; }",
            "static void *fakecuda_proc(const char *symbol) {"]
    for n in specials:
        target = newest if n.startswith("cuGetProcAddress") else n
        out.append(f'    if (!strcmp(symbol, "{n}")) return (void *){target};')
    out += ["    return (void *)fakecuda_no_device;", "}"]
    return "\n".join(out) + "\n"


def build(cuda_h, out_dir, cc="gcc", driver_version=13000, cuinit_env="FAKECUDA_CUINIT", fake_device=False):
    """Build out_dir/libcuda.so.1 and the libcuda.so link; return the number of symbols.
    cuinit_env names the environment variable whose value cuInit returns when it is set
    (for tests of an unusable driver); None: cuInit always succeeds (the wheel's copy).
    fake_device: the test driver with one device that launches nothing (_FAKE_DEVICE)."""
    names, codes = scan(cuda_h, cc)
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(out_dir, "libcuda.so.1")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "fakecuda.c")
        with open(src, "w") as f:
            f.write(c_source(names, codes, driver_version, cuinit_env, fake_device))
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-s", "-Wl,-soname,libcuda.so.1",
                        "-o", lib + ".tmp", src], check=True)
    os.replace(lib + ".tmp", lib)
    link = os.path.join(out_dir, "libcuda.so")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink("libcuda.so.1", link)
    return len(names)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda-h", required=True, help="path to the CUDA toolkit's cuda.h")
    ap.add_argument("--out", required=True, help="directory for libcuda.so.1 and libcuda.so")
    ap.add_argument("--cc", default=os.environ.get("CC", "gcc"), help="C compiler (default gcc)")
    ap.add_argument("--driver-version", type=int, default=13000,
                    help="what cuDriverGetVersion reports (default 13000)")
    ap.add_argument("--fake-device", action="store_true",
                    help="one sm_90 device whose kernels do nothing, launches logged (tests only)")
    a = ap.parse_args()
    n = build(a.cuda_h, a.out, a.cc, a.driver_version, fake_device=a.fake_device)
    print(f"make_libcuda: {n} driver functions -> {os.path.join(a.out, 'libcuda.so.1')}")


if __name__ == "__main__":
    main()
