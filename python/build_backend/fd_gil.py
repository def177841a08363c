"""Keeps the GIL held in the launch calls of gopy's generated code.

gopy wraps every exported Go function in PyEval_SaveThread / PyEval_RestoreThread,
so each call releases the GIL and takes it back. For the launch call (binding.Run:
a few microseconds of driver calls that never wait for the
GPU) that round trip costs more than it frees: with other Python threads waiting,
each release hands the GIL over (a futex wake, then a wait to get it back). On an
H200 host a Go call that launches nothing took 1.2 us alone and 5.7-8.7 us a call
at 8 threads, and 8 threads of decode calls 17.5 us a call against one thread's
11.1; with the GIL held in the launch, 11.4-12.1 against 11.0-11.4. The other functions (planning,
loading the kernels, sizing workspaces) keep releasing it.

gopy runs `goimports -w binding.go` on its generated file before compiling it; the
build puts this module first on PATH under that name (see fd_gobuild.build_go_tools),
so it edits the file and then runs the real goimports:

    python fd_gil.py REAL_GOIMPORTS -w binding.go

A generated function that no longer has the expected lines fails the build rather
than silently keeping the release.

The launch call is also taken by position (METH_FASTCALL) instead of through
pybindgen's PyArg_ParseTupleAndKeywords: for Run's 19 ints that parse costs more
than the Go call behind it. The same shim edits gopy's build.py (the pybindgen
script, written before goimports runs) so that, once it has written binding.c,
fast_call swaps the launch call's method for one that converts its arguments as
pybindgen's "L" and "K" would.
"""
import os
import re
import sys

# The exported wrappers (gopy names them binding_<Func>) that keep the GIL.
HOLD_GIL = ("binding_Run",)
_SAVE = "\t_saved_thread := C.PyEval_SaveThread()\n"
_RESTORE = re.compile(r"\t(defer )?C\.PyEval_RestoreThread\(_saved_thread\)\n")


def _body(source, name):
    """(start, end) of the generated function name in source; start is -1 when there is none."""
    start = source.find(f"\nfunc {name}(")
    return start, source.find("\n}\n", start)


def hold_gil(source, names=HOLD_GIL):
    """source (gopy's generated Go) with the GIL release removed from the named
    wrappers; raises ValueError when a wrapper or its release is not found."""
    for name in names:
        start, end = _body(source, name)
        if start < 0:
            raise ValueError(f"gopy output has no function {name}")
        body = source[start:end]
        if body.count(_SAVE) != 1 or len(_RESTORE.findall(body)) != 1:
            raise ValueError(f"{name} in gopy's output does not release the GIL the expected way")
        body = _RESTORE.sub("", body.replace(_SAVE, ""))
        source = source[:start] + body + source[end:]
    return source


def check(source, names=HOLD_GIL):
    """Raises RuntimeError unless the named wrappers in source (gopy's
    generated Go, after the build) keep the GIL: the build's check that the
    edit happened."""
    for name in names:
        start, end = _body(source, name)
        if start < 0 or "PyEval_SaveThread" in source[start:end]:
            raise RuntimeError(f"gopy's {name} releases the GIL: the goimports step (fd_gil.py) did not run")


# The extension functions (pybindgen names them after the Go exports) taken by position.
FAST_CALL = ("binding_Run",)
_PARSE = re.compile(r'PyArg_ParseTupleAndKeywords\(args, kwargs, \(char \*\) "([LK]+)"')
_ENTRY = "(PyCFunction) _wrap__binding_{0}, METH_KEYWORDS|METH_VARARGS"


def fast_call(source, names=FAST_CALL):
    """source (pybindgen's binding.c) with the named functions, whose arguments
    are all int64 ("L") or uint64 ("K") and whose result is an int64, taken by
    position (METH_FASTCALL); raises ValueError where pybindgen's code is not the
    expected one."""
    for name in names:
        start = source.find(f"\n_wrap__binding_{name}(")
        end = source.find("\n}\n", start)
        body = source[start:end]
        fmt = _PARSE.search(body)
        entry = _ENTRY.format(name)
        if (start < 0 or not fmt or f"retval = {name}(" not in body or 'Py_BuildValue((char *) "L", retval)' not in body
                or source.count(entry) != 1):
            raise ValueError(f"{name} in pybindgen's output is not the expected int function")
        kinds = fmt.group(1)
        convert = "".join(
            (f"    v{i} = PyLong_AsLongLong(args[{i}]);\n" if k == "L" else
             f"    if (!PyLong_Check(args[{i}])) {{\n"
             f"        PyErr_Format(PyExc_TypeError, \"{name}() argument {i + 1} must be int, not %.50s\", "
             f"Py_TYPE(args[{i}])->tp_name);\n        return NULL;\n    }}\n"
             f"    v{i} = PyLong_AsUnsignedLongLongMask(args[{i}]);\n")
            + f"    if (v{i} == ({'long long' if k == 'L' else 'unsigned long long'})-1 && PyErr_Occurred()) {{\n"
            "        return NULL;\n    }\n"
            for i, k in enumerate(kinds))
        fast = f"""
static PyObject *
_fd_fast_{name}(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{{
    {" ".join(f"{'long long' if k == 'L' else 'unsigned long long'} v{i};" for i, k in enumerate(kinds))}
    int64_t retval;
    if (nargs != {len(kinds)}) {{
        PyErr_Format(PyExc_TypeError, "{name}() takes {len(kinds)} positional arguments (%zd given)", nargs);
        return NULL;
    }}
{convert}    retval = {name}({", ".join(f"v{i}" for i in range(len(kinds)))});
    if (PyErr_Occurred()) {{
        return NULL;
    }}
    return PyLong_FromLongLong(retval);
}}
"""
        source = source[:end + 3] + fast + source[end + 3:]
        source = source.replace(entry, f"(PyCFunction)(void (*)(void)) _fd_fast_{name}, METH_FASTCALL")
    return source


def check_c(source, names=FAST_CALL):
    """Raises RuntimeError unless the named functions in source (binding.c,
    after the build) are taken by position: the build's check of fast_call."""
    for name in names:
        if f"_fd_fast_{name}, METH_FASTCALL" not in source:
            raise RuntimeError(f"pybindgen's {name} parses keywords: the build.py step (fd_gil.py) did not run")


def edit_c(path):
    """fast_call on the file at path (build.py calls it once it has written binding.c)."""
    with open(path) as f:
        source = f.read()
    with open(path, "w") as f:
        f.write(fast_call(source))


# Appended to gopy's build.py: after pybindgen writes binding.c, fast_call edits it.
_BUILD_PY_TAIL = """
import sys as _fd_sys
_fd_sys.path.insert(0, {here!r})
import fd_gil as _fd_gil
_fd_gil.edit_c('binding.c')
"""


def main(argv):
    real, args = argv[1], argv[2:]
    for path in args:
        if os.path.basename(path) == "binding.go":
            with open(path) as f:
                source = f.read()
            with open(path, "w") as f:
                f.write(hold_gil(source))
            build_py = os.path.join(os.path.dirname(path), "build.py")
            with open(build_py) as f:
                script = f.read()
            if "mod.generate(open('binding.c', 'w'))" not in script:
                raise ValueError("gopy's build.py does not write binding.c the expected way")
            script = script.replace("mod.generate(open('binding.c', 'w'))",
                                    "with open('binding.c', 'w') as _fd_out:\n    mod.generate(_fd_out)")
            with open(build_py, "w") as f:
                f.write(script + _BUILD_PY_TAIL.format(here=os.path.dirname(os.path.abspath(__file__))))
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv)
