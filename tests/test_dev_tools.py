"""The developer tools in dev/ still run where CI runs (no GPU): the sanitizer
driver plans every kernel path it is named for, and the thread benchmark
parses its arguments."""

import pathlib
import subprocess
import sys

import pytest

from conftest import has_extension

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
def test_sanitize_dry_run_reaches_every_path():
    # --dry-run builds each call's arguments on the meta device and checks that
    # its plan (H200, device=-1) still takes the path the case is named for.
    child = run("dev/sanitize.py", "--dry-run")
    assert child.returncode == 0, child.stderr[-2000:]
    lines = child.stdout.splitlines()
    assert lines[-1] == "done"
    plans = [line for line in lines if ": fd_split_kv_" in line]
    assert len(plans) >= 20
    assert any("combine fd_combine_f16_w16" in line for line in plans)
    assert any("cluster 1," not in line and "combine -" in line for line in plans)
    assert any("whole_items 0," not in line for line in plans)
    assert any("prefetch_tiles 0," not in line for line in plans)


@pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
def test_sanitize_only_runs_the_paths_it_names():
    child = run("dev/sanitize.py", "--dry-run", "--only", "^paged|merge_state$")
    assert child.returncode == 0, child.stderr[-2000:]
    names = [line.split(":")[0] for line in child.stdout.splitlines()]
    assert names[-1] == "done" and "merge_state" in names
    paths = [name for name in names if name not in ("done", "merge_state")]
    assert paths and all(name.startswith("paged") for name in paths), names


def test_threads_tool_parses_its_arguments():
    child = run("dev/threads.py", "--help")
    assert child.returncode == 0, child.stderr[-2000:]
    assert "--calls" in child.stdout
