"""setuptools entry point: metadata is in pyproject.toml; the version comes from
core/version.go and the Go build from python/build_backend/fd_gobuild.py."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "python", "build_backend"))

import fd_gobuild  # noqa: E402
from setuptools import setup  # noqa: E402

setup(**fd_gobuild.setup_kwargs())
