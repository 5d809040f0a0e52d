"""Every repository path and module that README.md, docs/DESIGN.md and benchmarks/RESULTS.md cite (in backticks
or as a link) exists. benchmarks/RESULTS-ARCHIVE.md is history and cites what was there then."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/DESIGN.md", "benchmarks/RESULTS.md")
TOP = ("jaxpage", "pallas_kernels", "serving", "tests", "benchmarks", "docs", ".ci")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./-]*[\w/])")
MODULE = re.compile(r"python3?(?:\.\d+)? -m ((?:jaxpage|benchmarks|serving|pallas_kernels)(?:\.\w+)+)")


def cited(text: str) -> tuple[set[str], set[str]]:
    """(paths, modules) cited in backtick spans and link targets."""
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)
    paths = {m.group(1) for span in spans for m in PATH.finditer(span) if span[m.end():m.end() + 1] not in "*<{"
             or m.end() == len(span)}
    modules = {m.group(1) for span in spans for m in MODULE.finditer(span)
               if not any(part.isupper() for part in m.group(1).split("."))}  # benchmarks.NAME: a placeholder
    return paths, modules


def module_exists(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_cited_path_and_module_exists(document):
    paths, modules = cited((ROOT / document).read_text())
    assert paths, f"{document} cites no path: the pattern is wrong"
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    missing += sorted(f"python -m {m}" for m in modules if not module_exists(m))
    assert not missing, f"{document} cites what is not in the tree: {missing}"


def test_the_citation_reader_finds_paths_and_modules():
    paths, modules = cited("run `python -m benchmarks.latency --json benchmarks/results/a.json` and see "
                           "[the kernel](pallas_kernels/kv_write/tpu.py), not benchmarks/old.py nor `x/benchmarks/y`, "
                           "`tests/test_<module>.py` or `python -m benchmarks.NAME`")
    assert paths == {"benchmarks/results/a.json", "pallas_kernels/kv_write/tpu.py"}
    assert modules == {"benchmarks.latency"}
    assert not module_exists("benchmarks.no_such_script") and module_exists("jaxpage.testing.structure")
