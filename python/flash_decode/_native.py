"""Loading of the gopy-built Go extension, only once it is safe to do so.

The extension links gorgonia.org/cu, whose package init calls ``cuInit`` and,
if that fails, ``os.Exit(1)``: importing it on a machine without a usable
CUDA driver would end the Python process. So :func:`binding` first asks the
driver itself (through ctypes, without touching torch's CUDA state) and only
then imports the extension. The outcome is cached either way.
"""

import ctypes
import gc
import importlib
import os
import threading

# The gopy-generated Python module that holds Decode, Plan and Version.
BINDING_MODULE = "flash_decode._binding.binding"

# FORCE_NATIVE_ENV=1 skips the device-count check (cuInit must still succeed):
# CI uses it with a stand-in libcuda.so.1 that reports no device.
FORCE_NATIVE_ENV = "FLASH_DECODE_FORCE_NATIVE"

_NO_DRIVER = "flash_decode needs an NVIDIA GPU with a CUDA driver: "

_lock = threading.Lock()
_module = None
_error = None  # message of the first failure, re-raised on every later call


def binding():
    """Return the Go extension module, importing it on first use.

    Raises:
        RuntimeError: no usable CUDA driver or device, or the extension is
            missing or cannot be loaded. The reason is in the message.
    """
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            _load()
    if _module is None:
        raise RuntimeError(_error)
    return _module


def _load():
    global _module, _error
    try:
        _check_driver(force=os.environ.get(FORCE_NATIVE_ENV) == "1")
        _check_no_other_go_runtime()
        module = importlib.import_module(BINDING_MODULE)
    except _Unusable as err:
        _error = _NO_DRIVER + str(err)
        return
    except ImportError as err:
        _error = (f"flash_decode's native extension {BINDING_MODULE} could not be "
                  f"imported ({err}); reinstall the package with `pip install .`")
        return
    _remove_gopy_gc_callbacks()
    _module = module


class _Unusable(Exception):
    """Why the driver or the process cannot host the Go extension."""


def _check_driver(force):
    """Raise _Unusable unless libcuda.so.1 loads, cuInit(0) succeeds and, unless
    force, at least one device is present."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise _Unusable(f"libcuda.so.1 could not be loaded ({err})") from None
    status = cuda.cuInit(0)
    if status != 0:
        raise _Unusable(f"cuInit(0) failed with CUresult {status}")
    if force:
        return
    count = ctypes.c_int(0)
    status = cuda.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        raise _Unusable(f"cuDeviceGetCount failed with CUresult {status}")
    if count.value < 1:
        raise _Unusable(f"the driver reports no CUDA device (set {FORCE_NATIVE_ENV}=1 "
                        "to load the extension anyway)")


def _check_no_other_go_runtime():
    """Raise _Unusable if capi's libflashdecode.so is already in this process:
    it carries its own Go runtime, and two Go runtimes cannot share a process."""
    try:
        with open("/proc/self/maps") as maps:
            loaded = "libflashdecode.so" in maps.read()
    except OSError:
        return
    if loaded:
        raise _Unusable("libflashdecode.so (the C library, with its own Go runtime) is "
                        "already loaded in this process; use one or the other")


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
