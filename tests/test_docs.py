"""The documentation a newcomer walks: README.md, docs/ and benchmarks/README.md link only to files
and headings that exist, and the settings reference in docs/settings/ is what the typed config
generates now (run the command the failure names to regenerate it)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ROOT / "docs" / "settings"
REGENERATE = "python -m hpcrlhf.config.reference docs/settings"
FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """`text` without code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: the heading's text, lower case, without punctuation but `-` and
    `_`, spaces as `-`; a repeated one gets `-1`, `-2`, ..."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", plain.strip().lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file, or heading anchor, does not exist."""
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.is_dir() or anchor not in anchors(file.read_text(encoding="utf-8"))):
            broken.append(f"{target}: no heading #{anchor} in {file}")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## `rollout.max_staleness`: one step ahead\n"
                                       "## Twice\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](other.md#rolloutmax_staleness-one-step-ahead) [ok](other.md#twice-1) [ok](#page)\n"
                    "[gone](missing.md) [no heading](other.md#nowhere) `[code](missing.md)` [web](https://x.org/y)\n"
                    "```\n[in a block](missing-too.md)\n```\n")
    assert [line.split(":")[0] for line in broken_links(page)] == ["missing.md", "other.md#nowhere"]


def test_every_docs_page_is_linked_from_the_index_and_starts_with_a_summary():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        name = page.relative_to(ROOT / "docs").as_posix()
        title, blank, summary = (page.read_text().splitlines() + ["", "", ""])[:3]
        assert title.startswith("# ") and not blank and summary.strip(), f"{name}: a title, then a one-line summary"
        if name != "index.md" and (page.parent != SETTINGS or page.name == "index.md"):
            assert f"]({name})" in index, f"docs/index.md does not link {name}"


def test_the_settings_reference_is_what_the_code_generates(tmp_path):
    """The checked-in pages equal a fresh run of the command this test's message tells."""
    subprocess.run([sys.executable, "-m", "hpcrlhf.config.reference", str(tmp_path)], cwd=ROOT, check=True)
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.md")}
    kept = {p.name: p.read_text() for p in SETTINGS.glob("*.md")}
    stale = sorted(name for name in fresh if fresh[name] != kept.get(name))
    extra = sorted(kept.keys() - fresh.keys())
    assert "index.md" in fresh and "ppo.md" in fresh and "generate.md" in fresh
    assert not stale, (f"docs/settings/ differs from what the config code generates ({', '.join(stale)}): "
                       f"run `{REGENERATE}` (or `make docs`) and commit the pages")
    assert not extra, ("docs/settings/ holds pages the config code no longer generates: git rm "
                       + " ".join(f"docs/settings/{name}" for name in extra))
