"""The documentation's links to the repository's own files lead somewhere: a file
moved or renamed without its README, BENCHMARKS.md or docs/ links fails here."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/*.md")])
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
