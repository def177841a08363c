"""The build's one edit of gopy's generated code: the launch calls keep the GIL
(python/build_backend/fd_gil.py). CPU only."""

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
        wrapper("binding_RunServing", defer=True) + wrapper("binding_RunServingX")
    edited = fd_gil.hold_gil(source)
    functions = {part.split("(", 1)[0]: part for part in edited.split("\nfunc ")[1:]}
    for name in ("binding_Run", "binding_RunServing"):
        assert "PyEval" not in functions[name], functions[name]
        assert "binding.X(int(handle))" in functions[name]
    for name in ("binding_Workspace", "binding_RunServingX"):
        assert functions[name].count("PyEval_SaveThread") == 1
        assert functions[name].count("PyEval_RestoreThread") == 1


def test_the_build_checks_the_edit_happened():
    source = "package main\n" + wrapper("binding_Run") + wrapper("binding_RunServing")
    with pytest.raises(RuntimeError, match="binding_Run releases the GIL"):
        fd_gil.check(source)
    fd_gil.check(fd_gil.hold_gil(source))


@pytest.mark.parametrize("source, message", [
    ("package main\n" + wrapper("binding_Run"), "no function binding_RunServing"),
    ("package main\n" + wrapper("binding_Run").replace("\t_saved_thread := C.PyEval_SaveThread()\n", "")
     + wrapper("binding_RunServing"), "binding_Run in gopy's output does not release the GIL"),
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
