"""Every Markdown file the repository's code and docs cite exists: a reader sent to a page finds it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FOLDERS = ("engine", "checks", "kvdoctor", "tests", "benchmarks", "examples", "docs")
# a path ending .md that is not the tail of a longer one (a URL's last segment is another site's file)
_CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")


def _citing_files() -> list[Path]:
    files = [p for folder in _FOLDERS for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return files + sorted(ROOT.glob("*.md"))


def _exists(ref: str, cited_in: Path) -> bool:
    """``ref`` resolved from the citing file's folder (a Markdown link), the repository root or docs/."""
    return any((base / ref).is_file() for base in (cited_in.parent, ROOT, ROOT / "docs"))


def _dangling_in(path: Path) -> list[tuple[int, str]]:
    return [(n, ref) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            for ref in _CITED.findall(line) if not _exists(ref, path)]


def test_every_cited_markdown_file_exists():
    # GIVEN every *.md path named in a .py or .md file of the repository THEN each names a file that is there
    found = [f"{path.relative_to(ROOT)}:{n}: {ref}" for path in _citing_files() for n, ref in _dangling_in(path)]
    assert found == []


def test_a_citation_of_a_missing_page_is_found(tmp_path):
    # GIVEN a module citing a page the repository lacks, one it has, and another site's file by URL
    missing = "docs/nowhere" + ".md"  # split, so this file cites no missing page itself
    src = tmp_path / "module.py"
    src.write_text(f'"""See {missing} and docs/trace-format.md; https://example.org/docs/README.md."""\n')
    # THEN only the missing page is reported, with its line
    assert _dangling_in(src) == [(1, missing)]
