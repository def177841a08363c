"""The documentation's links to the repository's own files lead somewhere: a file
moved or renamed without its README, BENCHMARKS.md or docs/ links fails here. The README
stays a manual of at most 250 lines, and its C client compiles against capi/flashdecode.h."""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
               *ROOT.glob("docs/*.md"), *ROOT.glob("examples/*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def local_links(doc):
    """The relative link targets of a Markdown file (anchors and web addresses left out)."""
    targets = (m.group(1).split("#")[0] for m in LINK.finditer(doc.read_text()))
    return [t for t in targets if t and not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(doc):
    if not doc.exists():
        pytest.skip(f"{doc.name} is not in this checkout")  # the tests run from an sdist too
    missing = [t for t in local_links(doc) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_readme_links_to_the_kernels_it_explains():
    links = local_links(ROOT / "README.md") if (ROOT / "README.md").exists() else pytest.skip("no README.md")
    for path in ("kernels/combine.cuh", "kernels/split_kv.cuh", "kernels/cluster_merge.cuh", "core/splits.go",
                 "examples/llama_decode.py"):
        assert path in links, path


def readme():
    path = ROOT / "README.md"
    return path.read_text() if path.exists() else pytest.skip("no README.md")


def test_the_readme_is_a_manual():
    text = readme()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: the long form goes to docs/"
    headings = re.findall(r"^## (.+)$", text, re.M)
    for section in ("Install", "Requirements", "Quick start", "API", "How it works", "Speed", "Go", "C",
                    "Development"):
        assert section in headings, section
    # The commands CI runs as the README's (.ci/run).
    assert "pip install '.[test]'" in text and "\npytest -q tests " in text
    # Cells of the argument table stay short: the long form is docs/api.md's.
    api = text.split("## API", 1)[1].split("\n## ", 1)[0]
    cells = [c.strip() for row in re.findall(r"^\|(.+)\|$", api, re.M) for c in row.split("|")]
    assert cells and max(map(len, cells)) <= 120, max(cells, key=len)


def test_the_readme_c_client_compiles(tmp_path):
    """The README's C client against the header (syntax and types only: no library needed).
    It uses the prepare/run API; a header without fd_prepare skips."""
    header = (ROOT / "capi" / "flashdecode.h").read_text()
    if "fd_prepare" not in header:
        pytest.skip("capi/flashdecode.h has no fd_prepare yet")
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    blocks = re.findall(r"^```c\n(.*?)^```", readme(), re.M | re.S)
    assert len(blocks) == 1, "the README has one C client"
    (tmp_path / "plan.c").write_text(blocks[0])
    cc = subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", "-fsyntax-only", f"-I{ROOT / 'capi'}",
                         str(tmp_path / "plan.c")], capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
