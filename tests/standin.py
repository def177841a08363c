"""The stand-in drivers that CPU-side tests load, from python/build_backend/make_libcuda.py.

.ci/run builds them and names their folders in FAKECUDA_DIR (cuInit succeeds, no device) and
FAKEDEVICE_DIR (one sm_90 device that launches nothing). Where those are unset, as in a fresh
checkout, they are built here from a CUDA 13 toolkit's cuda.h into _build/test-drivers/ (reused
while make_libcuda.py and cuda.h are unchanged). Without gcc or a cuda.h the folder is left
empty (with a warning that says why) and the tests that need it skip.
"""

import glob
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAKE_LIBCUDA = ROOT / "python" / "build_backend" / "make_libcuda.py"
# The CUDA headers the extension is built with (python/build_backend/fd_gobuild.py).
MIN_CUDA_VERSION = 13000


def cuda_version(cuda_h):
    """CUDA_VERSION as cuda.h defines it (12040 for 12.4), or 0."""
    m = re.search(r"^#define CUDA_VERSION (\d+)", pathlib.Path(cuda_h).read_text(errors="replace"), re.M)
    return int(m.group(1)) if m else 0


def find_cuda_h():
    """The newest cuda.h of CUDA_HOME, CUDA_PATH, the nvcc on PATH, /usr/local/cuda and the
    nvidia wheels installed beside this Python (the test extra's nvidia-cuda-runtime, or
    torch's); or None. The stand-in must export every driver function the extension calls, so
    headers older than the build's (CUDA 13) do not do."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    homes.append("/usr/local/cuda")
    found = [os.path.join(h, "include", "cuda.h") for h in homes if h]
    found += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "include", "cuda.h"))
    found = [f for f in found if os.path.isfile(f) and cuda_version(f) >= MIN_CUDA_VERSION]
    return pathlib.Path(max(found, key=cuda_version)) if found else None


def driver_dir(env, fake_device=False):
    """The folder of a stand-in libcuda.so.1: $env when set, else one built here (the
    --fake-device build with fake_device). The folder may hold no driver: see the module."""
    if os.environ.get(env):
        return pathlib.Path(os.environ[env])
    cuda_h = find_cuda_h()
    kind = "fakedevice" if fake_device else "fakecuda"
    if cuda_h is None or shutil.which(os.environ.get("CC", "gcc")) is None:
        missing = "a C compiler (gcc)" if cuda_h else "a CUDA 13 cuda.h (set CUDA_HOME, or pip install nvidia-cuda-runtime)"
        warnings.warn(f"no {kind} stand-in driver for the tests that load one: building it needs {missing}")
        return ROOT / "_build" / "test-drivers" / kind
    key = hashlib.sha256(MAKE_LIBCUDA.read_bytes() + str(cuda_h).encode()).hexdigest()[:12]
    folder = ROOT / "_build" / "test-drivers" / f"{kind}-{key}"
    if not (folder / "libcuda.so.1").exists():
        cmd = [sys.executable, str(MAKE_LIBCUDA), "--cuda-h", str(cuda_h), "--out", str(folder)]
        built = subprocess.run(cmd + (["--fake-device"] if fake_device else []), capture_output=True, text=True)
        if built.returncode != 0:
            warnings.warn(f"make_libcuda.py could not build the {kind} stand-in driver: {built.stderr.strip()[-300:]}")
    return folder
