"""The gopy-built Go extension, loaded once it is safe to, and its errors. gorgonia.org/cu's
init exits the process if cuInit fails, so :func:`binding` asks the driver through ctypes
first; planning without a GPU (planner_only) loads the wheel's stand-in libcuda (STANDIN).
Each outcome is kept; a child forked after loading refuses every call (Go's runtime does not
survive fork without exec)."""

import ctypes
import functools
import gc
import importlib
import os
import struct
import threading

import torch

BINDING_MODULE = "flash_decode._binding.binding"
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_binding", "libcuda_standin.so")
FORCE_NATIVE_ENV = "FLASH_DECODE_FORCE_NATIVE"  # 1: no device count (CI's stand-in has no device)

_NO_DRIVER = "flash_decode needs an NVIDIA GPU with a CUDA driver: "
_FORKED = ("flash_decode was loaded in the parent of this forked process, and its Go runtime does not survive "
           "fork without exec: start worker processes with the spawn start method "
           "(multiprocessing.get_context('spawn'), or torch.multiprocessing.set_start_method('spawn'))")
_NO_DEVICE = 100  # cuInit's CUDA_ERROR_NO_DEVICE: every GPU hidden (CUDA_VISIBLE_DEVICES="")
_ERRORS = {1: ValueError, 2: NotImplementedError, 8: TypeError}  # the binding's error kinds (capi's fd_status)
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float8_e4m3fn: 4,
               torch.float8_e5m2: 5, torch.int32: 6, torch.int64: 7, torch.float64: 8}  # core.DType (0: another)

_lock = threading.Lock()
_module = None
_errors = {}     # planner_only -> why binding() raises
_loaded = set()  # the planner_only values binding() returns the module for
_driver = None   # _probe_driver's answer, once asked

# The CUstream handle of torch's current stream on a device index (torch's raw call has no Python frame).
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)


def binding(planner_only=False):
    """The Go extension module, imported on first use; RuntimeError saying why where it cannot serve."""
    planner_only = bool(planner_only)
    if planner_only not in _loaded:
        with _lock:
            if planner_only not in _loaded and planner_only not in _errors:
                _load(planner_only)
        if planner_only in _errors:
            raise RuntimeError(_errors[planner_only])
    return _module


def function(native, name):
    """native's function name, past gopy's module-level wrapper, which only forwards."""
    return getattr(getattr(native, "_binding", None), "binding_" + name, None) or getattr(native, name)


def error(native, status):
    """The exception of a negative result of the binding, by its kind, with the core's message."""
    return _ERRORS.get(native.ErrorKind(status), RuntimeError)(native.ErrorMessage(status))


@functools.lru_cache(maxsize=None)
def record_format(native, name):
    """The binding's record name (its fields from name + "Fields"): their places by name, and its struct."""
    fields = [f.split(":") for f in getattr(native, name + "Fields")().split(",")]
    return {field: i for i, (field, _) in enumerate(fields)}, struct.Struct("=" + "".join(k for _, k in fields))


def pack(native, name, *fields):
    """The bytes of the binding's record name of fields (dicts by field name; 0 where not given). Dimensions
    past those a descriptor holds are left out: its rank tells the core."""
    places, record = record_format(native, name)
    values = [0] * len(places)
    for f in fields:
        for field, value in f.items():
            if field in places:
                values[places[field]] = value
            elif "[" not in field:
                raise RuntimeError(f"flash_decode's native extension has no {name} field {field}: reinstall it")
    return record.pack(*values)


def record(native, name, *fields):
    """pack's record in a buffer the binding reads."""
    data = pack(native, name, *fields)
    return ctypes.create_string_buffer(data, len(data))


def code(dtype):
    """A dtype argument's core.DType code: 0 for None, -1 for what has none."""
    return 0 if dtype is None else DTYPE_CODES.get(dtype, -1)


def desc(name, dtype, shape, strides, device):
    """The record's fields of tensor argument name (core.TensorDesc)."""
    fields = {f"{name}.given": 1, f"{name}.dtype": DTYPE_CODES.get(dtype, 0), f"{name}.device": device,
              f"{name}.rank": len(shape)}
    for i, (size, stride) in enumerate(zip(shape, strides)):
        fields[f"{name}.shape[{i}]"], fields[f"{name}.strides[{i}]"] = size, stride
    return fields


def _load(planner_only):
    global _module, _driver
    if _driver is None:
        _driver = _probe_driver(force=os.environ.get(FORCE_NATIVE_ENV) == "1")
    error, device_error, standin = _driver
    if not planner_only:
        error = error or device_error
    elif standin:  # the stand-in libcuda, loaded globally, serves the extension's planning
        try:
            ctypes.CDLL(STANDIN, mode=ctypes.RTLD_GLOBAL)
            error = None
        except OSError as err:
            error = f"{error}, and the stand-in for planning could not be loaded ({err})"
    try:
        with open("/proc/self/maps") as maps:  # capi's library carries a Go runtime of its own
            if error is None and "libflashdecode.so" in maps.read():
                error = "libflashdecode.so (the C library, with its own Go runtime) is loaded: use one or the other"
    except OSError:
        pass
    if error is not None:
        _errors[planner_only] = _NO_DRIVER + error
        return
    if _module is None:
        try:
            module = importlib.import_module(BINDING_MODULE)
        except ImportError as err:
            _errors[False] = _errors[True] = (f"flash_decode's native extension {BINDING_MODULE} could not be "
                                              f"imported ({err}); reinstall the package with `pip install .`")
            return
        # gopy's hooks run a full Go GC after every Python collection; the binding holds no Go object.
        gc.callbacks[:] = [cb for cb in gc.callbacks if "_gopy_gc_cb" not in (
            getattr(cb, "__name__", ""), getattr(cb, "__qualname__", ""))]
        os.register_at_fork(after_in_child=_forked)
        _module = module
    _loaded.add(planner_only)


def _forked():
    _loaded.clear()
    _errors[False] = _errors[True] = _FORKED


def _probe_driver(force):
    """libcuda.so.1 loaded, cuInit(0) called and, unless force, the devices counted: why the
    driver cannot serve, why it cannot serve a GPU call, and whether the stand-in may plan."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return f"libcuda.so.1 could not be loaded ({err})", None, True
    if (status := cuda.cuInit(0)) == _NO_DEVICE:
        return f"cuInit(0) found no CUDA device (CUresult {status})", None, True
    if status != 0:
        return f"cuInit(0) failed with CUresult {status}", None, False
    count = ctypes.c_int(0)
    if not force and (status := cuda.cuDeviceGetCount(ctypes.byref(count))) != 0:
        return None, f"cuDeviceGetCount failed with CUresult {status}", False
    if not force and count.value < 1:
        return None, f"the driver reports no CUDA device ({FORCE_NATIVE_ENV}=1 loads the extension anyway)", False
    return None, None, False
