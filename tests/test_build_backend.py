"""The build's edits of gopy's generated code: the launch call keeps the GIL and is
taken by position (python/build_backend/fd_gil.py). CPU only."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fd_gil", ROOT / "python" / "build_backend" / "fd_gil.py")
fd_gil = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fd_gil)


def wrapper(name, defer=False):
    """A wrapper as gopy v0.5.0 generates it (a deferred restore where the Go
    function returns one value that is not an error)."""
    restore = "\tdefer C.PyEval_RestoreThread(_saved_thread)\n" if defer else ""
    after = "" if defer else "\tC.PyEval_RestoreThread(_saved_thread)\n"
    return (f"\n//export {name}\nfunc {name}(handle C.longlong) C.longlong {{\n"
            f"\t_saved_thread := C.PyEval_SaveThread()\n{restore}"
            f"\tcret, __err := binding.X(int(handle))\n\n{after}"
            "\tif __err != nil {\n\t\treturn C.longlong(0)\n\t}\n\treturn C.longlong(cret)\n}\n")


def test_the_launch_calls_keep_the_gil_and_the_others_release_it():
    source = "package main\n" + wrapper("binding_Run") + wrapper("binding_Workspace") + \
        wrapper("binding_RunX", defer=True)
    edited = fd_gil.hold_gil(source)
    functions = {part.split("(", 1)[0]: part for part in edited.split("\nfunc ")[1:]}
    assert "PyEval" not in functions["binding_Run"], functions["binding_Run"]
    assert "binding.X(int(handle))" in functions["binding_Run"]
    for name in ("binding_Workspace", "binding_RunX"):
        assert functions[name].count("PyEval_SaveThread") == 1
        assert functions[name].count("PyEval_RestoreThread") == 1


def test_the_build_checks_the_edit_happened():
    source = "package main\n" + wrapper("binding_Run") + wrapper("binding_Workspace")
    with pytest.raises(RuntimeError, match="binding_Run releases the GIL"):
        fd_gil.check(source)
    fd_gil.check(fd_gil.hold_gil(source))


@pytest.mark.parametrize("source, message", [
    ("package main\n" + wrapper("binding_Workspace"), "no function binding_Run"),
    ("package main\n" + wrapper("binding_Run").replace("\t_saved_thread := C.PyEval_SaveThread()\n", ""),
     "binding_Run in gopy's output does not release the GIL"),
])
def test_an_unexpected_gopy_output_fails_the_build(source, message):
    with pytest.raises(ValueError, match=message):
        fd_gil.hold_gil(source)


def test_this_checkouts_build_holds_the_gil_in_run():
    generated = ROOT / "_build" / "gopy" / "binding.go"
    if not generated.exists():
        pytest.skip("no in-tree build (_build/gopy/binding.go)")
    source = generated.read_text()
    run = source[source.index("\nfunc binding_Run("):]
    run = run[:run.index("\n}\n")]
    assert "PyEval_SaveThread" not in run
    workspace = source[source.index("\nfunc binding_Workspace("):]
    assert "PyEval_SaveThread" in workspace[:workspace.index("\n}\n")]


def test_cgo_ldflags_allow_admits_exactly_the_interpreters_ldshared_flags(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "python" / "build_backend"))
    import fd_gobuild
    allow = fd_gobuild.ldshared_allow("gcc -pthread -shared -fwrapv -Wl,-rpath,/opt/py-3.11/lib "
                                      "-Wl,-z,relro -bundle -fwrapv")
    for flag in ("-pthread", "-shared", "-fwrapv", "-Wl,-rpath,/opt/py-3.11/lib", "-Wl,-z,relro"):
        assert re.fullmatch(allow, flag), flag
    for flag in ("gcc", "-bundle", "-Wl,--wrap=malloc", "-specs=/tmp/x", "-Wl,-rpath,/opt/py-3.11/libX", "-fwrapvx"):
        assert not re.fullmatch(allow, flag), flag
    assert fd_gobuild.ldshared_allow(None) == ""


def pybindgen_wrapper(name, fmt):
    """A function and its method-table entry as pybindgen 0.22.1 generates them
    for gopy (its arguments' PyArg format, an int64 result)."""
    params = ", ".join(f"&a{i}" for i in range(len(fmt)))
    return (f"PyObject *\n_wrap__binding_{name}(PyObject * PYBINDGEN_UNUSED(dummy), PyObject *args, PyObject *kwargs)\n{{\n"
            f"    if (!PyArg_ParseTupleAndKeywords(args, kwargs, (char *) \"{fmt}\", (char **) keywords, {params})) {{\n"
            f"        return NULL;\n    }}\n    retval = {name}({params});\n"
            "    py_retval = Py_BuildValue((char *) \"L\", retval);\n    return py_retval;\n}\n",
            f"    {{(char *) \"{name}\", (PyCFunction) _wrap__binding_{name}, METH_KEYWORDS|METH_VARARGS, \"doc\" }},\n")


def test_the_launch_call_is_taken_by_position():
    run, run_entry = pybindgen_wrapper("binding_Run", "LLKKL")
    other, other_entry = pybindgen_wrapper("binding_Workspace", "LL")
    source = "\n" + run + "\n" + other + "static PyMethodDef m[] = {\n" + run_entry + other_entry + "};\n"
    with pytest.raises(RuntimeError, match="binding_Run parses keywords"):
        fd_gil.check_c(source)
    edited = fd_gil.fast_call(source)
    fd_gil.check_c(edited)
    assert "(PyCFunction)(void (*)(void)) _fd_fast_binding_Run, METH_FASTCALL" in edited
    assert other_entry in edited  # the others keep pybindgen's parse
    fast = edited[edited.index("_fd_fast_binding_Run(PyObject"):]
    fast = fast[:fast.index("\n}\n")]
    assert "nargs != 5" in fast and "retval = binding_Run(v0, v1, v2, v3, v4);" in fast
    # "L" as PyArg's (any __index__), "K" an int only, masked.
    assert [f"v{i} = PyLong_AsLongLong" in fast for i in range(5)] == [True, True, False, False, True]
    assert fast.count("PyLong_Check(") == 2 and fast.count("PyLong_AsUnsignedLongLongMask(") == 2


def test_an_unexpected_pybindgen_output_fails_the_build():
    run, entry = pybindgen_wrapper("binding_Run", "LLdK")
    with pytest.raises(ValueError, match="binding_Run in pybindgen's output is not the expected int function"):
        fd_gil.fast_call("\n" + run + entry)
    run, entry = pybindgen_wrapper("binding_Run", "LLK")
    with pytest.raises(ValueError, match="not the expected int function"):
        fd_gil.fast_call("\n" + run)  # no method-table entry


def test_this_checkouts_build_takes_run_by_position():
    generated = ROOT / "_build" / "gopy" / "binding.c"
    if not generated.exists():
        pytest.skip("no in-tree build (_build/gopy/binding.c)")
    fd_gil.check_c(generated.read_text())


def test_the_cuda12_tools_file_pins_the_builds_cuda12_wheels(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "python" / "build_backend"))
    import fd_cuda12
    pinned = [line.split()[0] for line in (ROOT / "dev" / "cuda12-tools.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert pinned == fd_cuda12.CU12_WHEELS
    assert all(w.rsplit("==", 1)[1].startswith(fd_cuda12.CU12_RELEASE + ".") for w in pinned)


def test_fd_cuda_picks_the_kernels_compiler(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "python" / "build_backend"))
    import fd_cuda12
    import fd_gobuild
    monkeypatch.delenv("FD_CUDA", raising=False)
    assert fd_gobuild.cuda_major() == "13"
    monkeypatch.setenv("FD_CUDA", "12")
    monkeypatch.setattr(fd_cuda12, "find_tools", lambda *a: (_ for _ in ()).throw(RuntimeError("none")))
    assert set(fd_cuda12.CU12_WHEELS) <= set(fd_gobuild.build_requirements())
    monkeypatch.setenv("FD_CUDA", "11")
    with pytest.raises(RuntimeError, match="FD_CUDA=11"):
        fd_gobuild.cuda_major()


def test_ptxas_spills_are_read_per_kernel(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "python" / "build_backend"))
    import fd_cuda12
    log = ("ptxas info    : Compiling entry function 'fd_a' for 'sm_90'\n"
           "ptxas info    : Function properties for fd_a\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Compiling entry function 'fd_b' for 'sm_90'\n"
           "ptxas info    : Function properties for fd_b\n"
           "    16 bytes stack frame, 16 bytes spill stores, 8 bytes spill loads\n")
    assert fd_cuda12.spills(log) == {"fd_b": (16, 8)}


def test_the_cuda12_build_finds_every_listed_kernel_in_a_cubin(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "python" / "build_backend"))
    import fd_cuda12
    (tmp_path / "_instances.inc").write_text(
        "// generated\nFD_SPLIT_KV(fd_split_kv_f16_d64_r16, half, half, 64, 16)\n"
        "static_assert(true, \"\");\nFD_COMBINE(fd_combine_f16, half, 4, (128, 1))\n")
    names = fd_cuda12.listed_kernels(str(tmp_path))
    assert names == ["fd_split_kv_f16_d64_r16", "fd_combine_f16", "fd_combine_f16_bal"]
    cubin = b"\0.text.fd_split_kv_f16_d64_r16\0.text.fd_combine_f16_bal\0"
    assert fd_cuda12.missing_kernels(cubin, names) == ["fd_combine_f16"]


def test_both_kernel_builds_compile_the_same_architectures(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "python" / "build_backend"))
    import fd_cuda12
    nvcc = next(line for line in (ROOT / "core" / "cuda" / "gen.go").read_text().splitlines()
                if line.startswith("//go:generate nvcc"))
    sass, ptx = {}, []
    for virtual, codes in re.findall(r"arch=compute_(\d+),code=\[?([\w,]+)\]?", nvcc):
        for code in codes.split(","):
            if code.startswith("sm_"):
                sass[code[3:]] = virtual
            else:
                ptx.append(code[8:])
    assert list(sass) == fd_cuda12.ARCHS
    assert sass == {a: fd_cuda12.sass_source(a) for a in fd_cuda12.ARCHS}
    assert ptx == [fd_cuda12.PTX_ARCH]
