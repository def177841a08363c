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


def main(argv):
    real, args = argv[1], argv[2:]
    for path in args:
        if os.path.basename(path) == "binding.go":
            with open(path) as f:
                source = f.read()
            with open(path, "w") as f:
                f.write(hold_gil(source))
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv)
