"""Loading of the gopy-built Go extension, only once it is safe to do so.

The extension links gorgonia.org/cu, whose package init calls ``cuInit`` and,
if that fails, ``os.Exit(1)``; and it needs a libcuda.so.1 to load at all. So
:func:`binding` first asks the driver itself (through ctypes, without touching
torch's CUDA state) and only then imports the extension.

Two ways to ask for it:

- ``binding()``: for decoding and device plans. Needs a libcuda.so.1 whose
  ``cuInit`` succeeds and at least one device.
- ``binding(planner_only=True)``: for what never touches a GPU (``Plan`` with
  device < 0, ``Version``). Where no libcuda.so.1 can be loaded, it first loads
  the stand-in the wheel carries (:data:`STANDIN`: ``cuInit`` succeeds, no
  device; see python/build_backend/make_libcuda.py), which then answers for
  libcuda.so.1 in this process: the CUDA runtime (torch's too) sees a driver
  without a device, and ``binding()`` still raises. Where the driver loads but
  its ``cuInit`` reports no device (every GPU hidden by CUDA_VISIBLE_DEVICES,
  or none installed), the stand-in is loaded too, globally, so that its
  functions are the ones the extension binds. A libcuda.so.1 whose ``cuInit``
  fails otherwise is a broken driver: both raise.

The driver check runs once; each outcome is cached, and a failure is re-raised
on every later call.
"""

import ctypes
import gc
import importlib
import os
import threading

# The gopy-generated Python module that holds Prepare, Run, Plan and Version.
BINDING_MODULE = "flash_decode._binding.binding"

# The stand-in libcuda.so.1 built into the wheel (python/build_backend/fd_gobuild.py).
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_binding", "libcuda_standin.so")

# FORCE_NATIVE_ENV=1 skips the device-count check (cuInit must still succeed):
# CI uses it with a stand-in libcuda.so.1 that reports no device.
FORCE_NATIVE_ENV = "FLASH_DECODE_FORCE_NATIVE"

_NO_DRIVER = "flash_decode needs an NVIDIA GPU with a CUDA driver: "
_CUDA_ERROR_NO_DEVICE = 100  # cuInit's answer where the driver sees no GPU (CUDA_VISIBLE_DEVICES="")

_lock = threading.Lock()
_module = None
_errors = {}   # planner_only -> message of its first failure
_loaded = set()  # the planner_only values that binding() has returned the module for
_driver = None  # _Driver, once probed


class _Driver:
    """What the probe found: libcuda_error (None if libcuda.so.1 loads), cuinit_error
    (None if cuInit(0) succeeds) and device_error (None if a device is present, or if
    FORCE_NATIVE_ENV says not to count)."""

    def __init__(self, libcuda_error=None, cuinit_error=None, device_error=None, no_device=False):
        self.libcuda_error, self.cuinit_error, self.device_error = libcuda_error, cuinit_error, device_error
        self.no_device = no_device  # cuInit said CUDA_ERROR_NO_DEVICE: a driver with every GPU hidden

    @property
    def error(self):
        """Why decoding cannot run here, or None."""
        return self.libcuda_error or self.cuinit_error or self.device_error


def binding(planner_only=False):
    """Return the Go extension module, importing it on first use.

    Args:
        planner_only: the caller only plans without a device (``Plan`` with
            device < 0) or asks ``Version``: no GPU or driver is needed (see
            the module doc).

    Raises:
        RuntimeError: no usable CUDA driver or device (unless planner_only),
            a driver whose cuInit fails, or the extension is missing or cannot
            be loaded. The reason is in the message.
    """
    planner_only = bool(planner_only)
    if planner_only in _loaded:
        return _module
    with _lock:
        if planner_only not in _loaded and planner_only not in _errors:
            _load(planner_only)
    if planner_only in _errors:
        raise RuntimeError(_errors[planner_only])
    return _module


def _load(planner_only):
    global _module, _driver
    if _driver is None:
        _driver = _probe_driver(force=os.environ.get(FORCE_NATIVE_ENV) == "1")
    if planner_only:
        error = _driver.cuinit_error
        if _driver.libcuda_error or _driver.no_device:
            error = _load_standin(_driver.libcuda_error or _driver.cuinit_error)
    else:
        error = _driver.error
    if error is None:
        error = _other_go_runtime()
    if error is not None:
        _errors[planner_only] = _NO_DRIVER + error
        return
    if _module is None:
        try:
            module = importlib.import_module(BINDING_MODULE)
        except ImportError as err:
            message = (f"flash_decode's native extension {BINDING_MODULE} could not be "
                       f"imported ({err}); reinstall the package with `pip install .`")
            _errors[False] = _errors[True] = message
            return
        _remove_gopy_gc_callbacks()
        _module = module
    _loaded.add(planner_only)


def _probe_driver(force):
    """Load libcuda.so.1, call cuInit(0) and, unless force, count devices."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return _Driver(libcuda_error=f"libcuda.so.1 could not be loaded ({err})")
    status = cuda.cuInit(0)
    if status != 0:
        if status == _CUDA_ERROR_NO_DEVICE:
            return _Driver(cuinit_error=f"cuInit(0) found no CUDA device (CUresult {status})", no_device=True)
        return _Driver(cuinit_error=f"cuInit(0) failed with CUresult {status}")
    if force:
        return _Driver()
    count = ctypes.c_int(0)
    status = cuda.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        return _Driver(device_error=f"cuDeviceGetCount failed with CUresult {status}")
    if count.value < 1:
        return _Driver(device_error=f"the driver reports no CUDA device (set {FORCE_NATIVE_ENV}=1 "
                                    "to load the extension anyway)")
    return _Driver()


def _load_standin(why):
    """Load STANDIN globally, so that it answers for libcuda.so.1 when the extension
    loads; return None, or why planning cannot run either."""
    if not os.path.isfile(STANDIN):
        return f"{why}, and this installation has no stand-in for planning ({STANDIN})"
    try:
        ctypes.CDLL(STANDIN, mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        return f"{why}, and the stand-in for planning could not be loaded ({err})"
    return None


def _other_go_runtime():
    """Return why not, if capi's libflashdecode.so is already in this process: it
    carries its own Go runtime, and two Go runtimes cannot share a process."""
    try:
        with open("/proc/self/maps") as maps:
            loaded = "libflashdecode.so" in maps.read()
    except OSError:
        return None
    if loaded:
        return ("libflashdecode.so (the C library, with its own Go runtime) is "
                "already loaded in this process; use one or the other")
    return None


def _remove_gopy_gc_callbacks():
    """Drop the ``_gopy_gc_cb`` hooks that gopy's generated modules append to
    gc.callbacks (one per generated module: two for us).

    Each runs a full, synchronous Go GC after every Python collection, which
    costs about 560 us per gc.collect(0) (0.1 us without) and so slows every
    Python program that imports us. We hold no Go objects through gopy handles:
    the binding passes only ints, floats and strings, so there is nothing for
    those hooks to reclaim; Go's own GC still runs on its own schedule.
    """
    gc.callbacks[:] = [cb for cb in gc.callbacks
                       if "_gopy_gc_cb" not in (getattr(cb, "__name__", ""),
                                                getattr(cb, "__qualname__", ""))]
