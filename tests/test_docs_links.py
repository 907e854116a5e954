"""Every relative link of README.md and docs/*.md resolves: the file exists, and a `#anchor` names a
heading of the target page (GitHub's slugs). Links inside code (fenced blocks, `inline code`) and
external links (http, https, mailto) are not checked."""
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)          # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()                        # html tags
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(page: Path):
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def test_slugs_are_githubs():
    assert slug("Checkpoints and resuming") == "checkpoints-and-resuming"
    assert slug("Converting checkpoints: Hugging Face format and back (`tools/convert_checkpoint.py`)") \
        == "converting-checkpoints-hugging-face-format-and-back-toolsconvert_checkpointpy"
    assert slug("Output files: permissions, `-`, FIFOs and devices") == "output-files-permissions---fifos-and-devices"


def broken_links(page: Path) -> list[str]:
    """'FILE:LINE: TARGET: why' for each relative link of page that does not resolve."""
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):       # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / unquote(path)).resolve() if path else page
        where = f"{page.name}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor:
            if destination.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif unquote(anchor) not in anchors(destination):
                problems.append(f"{where}: no heading with that anchor in {destination.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.exists()
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_the_check_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` section: yes\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#a-code-section-yes) [ok](#page) [ext](https://example.com/x)\n"
                    "`[in code](missing.md)`\n```\n[in a fence](missing.md)\n```\n"
                    "[gone](missing.md) [bad anchor](other.md#nope) [bad local](#nope)\n")
    assert [p.split(": ", 1)[1] for p in broken_links(page)] == [
        "missing.md: no such file", "other.md#nope: no heading with that anchor in other.md",
        "#nope: no heading with that anchor in page.md"]


def test_docs_named_in_the_code_exist():
    """`docs/NAME.md` in docstrings, --help texts, error messages and comments names a page that exists."""
    missing = []
    for folder in ("megatron_pmlm", "tools", "data_prep", "slurm", "tests"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh") or not path.is_file() or path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for name in re.findall(r"\bdocs/[\w.-]+\.md\b", line):
                    if not (ROOT / name).exists():
                        missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    for name in ("Makefile", "pyproject.toml"):
        for name_md in re.findall(r"\bdocs/[\w.-]+\.md\b", (ROOT / name).read_text(encoding="utf-8")):
            if not (ROOT / name_md).exists():
                missing.append(f"{name}: {name_md}")
    assert not missing, "\n".join(missing)
