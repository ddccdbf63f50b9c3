"""The documentation that lives in the repository: its guides run, its links resolve, and it
names no file outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Guide pages whose ```python blocks are executed, each page in order in one namespace.
#: A page not written yet is skipped.
GUIDES = ("docs/write-a-detector.md", "docs/write-a-sink.md", "docs/design.md")

#: A block whose first line starts with this is a fragment (``trainer.fit(model)``) or an
#: excerpt of the source: not run.
NOT_RUN = "# not run"

#: Team files outside the repository: users never see them, so nothing may point at them.
#: Spelt in parts, so that this file does not name them itself.
OUTSIDE = (*(f"{name}.md" for name in ("DESIGN", "REFERENCES", "CONVENTIONS")), "../" + "shared")

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_FENCED = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`[^`\n]*`")
# [text](target "title") and [text]: target
_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)[^)]*\)|^\[[^\]]+\]:[ \t]*(\S+)", re.MULTILINE)
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a markdown text, in order, without the fragments."""
    blocks = [m.group(1) for m in _FENCE.finditer(text)]
    return [b for b in blocks if not b.lstrip().startswith(NOT_RUN)]


@pytest.mark.parametrize("page", GUIDES)
def test_guide_runs(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / page
    if not path.exists():
        pytest.skip(f"{page} is not written yet")
    blocks = python_blocks(path.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip(f"{page} has no python block to run")
    monkeypatch.chdir(tmp_path)  # whatever a guide writes (runs/, logs) lands here
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    for i, block in enumerate(blocks, start=1):
        code = compile(block, f"{page} (python block {i})", "exec")
        exec(code, namespace)


def test_python_blocks_are_found_and_fragments_skipped() -> None:
    text = (
        "intro\n```python\na = 1\n```\n\n```python\n# not run\ntrainer.fit(model)\n```\n"
        "```bash\nmake test\n```\n```python\nb = a + 1\n```\n"
    )
    assert python_blocks(text) == ["a = 1\n", "b = a + 1\n"]


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _links(text: str) -> list[str]:
    """The link targets of a markdown text that are neither web addresses nor in code."""
    text = _INLINE.sub("", _FENCED.sub("", text))
    targets = [a or b for a, b in _LINK.findall(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown text: lower case, punctuation
    dropped, spaces as hyphens, and -1, -2 ... after a repeated one."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCED.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in _links(page.read_text(encoding="utf-8")):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif (
            anchor
            and target.suffix == ".md"
            and anchor not in anchors(target.read_text(encoding="utf-8"))
        ):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


def test_link_and_anchor_finders() -> None:
    text = (
        "See [a](docs/a.md), [b](b.md#part), [web](https://x.org/y.md), [top](#top), "
        '`[not](code.md)`, [t](c.md "title").\n[ref]: d.md\n```\n[no](e.md)\n```\n'
    )
    assert _links(text) == ["docs/a.md", "b.md#part", "#top", "c.md", "d.md"]
    headings = "# Top\n## What `make demo` prints\n```\n# a comment\n```\n## Top\n### A, b (c)\n"
    assert anchors(headings) == {"top", "what-make-demo-prints", "top-1", "a-b-c"}


def _repository_files() -> list[Path]:
    """Every file of the repository: what git tracks or would add (so nothing ignored, such
    as .venv or build output), or, outside a git checkout, every file but .git and .venv."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        files = [ROOT / name for name in out.decode("utf-8").split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__"}
        files = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in files if p.is_file()]


def test_nothing_names_a_file_outside_the_repository() -> None:
    offenders = []
    for path in _repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for needle in OUTSIDE:
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, "files name team files users never see:\n" + "\n".join(offenders)
