"""The docs name what is there: every relative link, every repository file path and every module
of design.md's layout exists, and every module under moe_perf/ is in that layout.

Each check is a function of text and a root directory, so each is first shown to fail on a
planted bad document in a temporary directory, then run on the repository's own docs.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Markdown links and images: [text](target) or ![alt](target "title").
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
# A path into this repository: a top-level directory of it, then a file with an extension. The
# look-behind leaves out paths inside other trees (`~/.cache/moe_perf/...`, `<tree>/bench/...`).
REPO_PATH = re.compile(
    r"(?<![\w./~<>$-])(?:moe_perf|bench|tests|conf|docs|hydra_plugins)/"
    r"[\w./-]*?\.(?:py|md|yaml|sh|png)\b"
)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def docs_of(root: Path) -> list[Path]:
    """README.md, every page under docs/, and the config files whose comments name modules."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p for p in pages if p.is_file()] + sorted((root / "conf").rglob("*.yaml"))


def prose(markdown: str) -> str:
    """The text a reader sees as links: fenced blocks and inline code taken out."""
    return INLINE_CODE.sub("", FENCE.sub("", markdown))


def anchors(markdown: str) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces to hyphens."""
    slugs = [re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in HEADING.findall(
        FENCE.sub("", markdown))]  # fmt: skip
    seen: dict[str, int] = {}
    unique = set()
    for slug in slugs:  # a repeated heading gets -1, -2, ... as on GitHub
        unique.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return unique


def broken_links(page: Path) -> list[str]:
    """Each relative link of a Markdown page whose file, or whose heading anchor, is not there."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def missing_paths(page: Path, root: Path) -> list[str]:
    """Each repository file path a page names (moe_perf/..., bench/..., ...) that does not exist."""
    named = sorted(set(REPO_PATH.findall(page.read_text())))
    return [f"{page.name}: {path}" for path in named if not (root / path).exists()]


def layout_listing(design: str) -> set[str]:
    """The moe_perf/ entries of design.md's layout block, as paths: one entry a line, nesting by
    two-space indent, a directory ending in `/`."""
    block = design.split("## Layout", 1)[1].split("```", 2)[1]
    entries, stack = set(), []  # stack: (indent, directory) of the open directories
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not name or (indent == 0 and name != "moe_perf/") or (indent and not stack):
            continue
        path = "".join(d for _, d in stack) + name
        entries.add(path.rstrip("/"))
        if name.endswith("/"):
            stack.append((indent, name))
    return entries


def package_modules(root: Path) -> set[str]:
    """Every module and package under moe_perf/, `__init__.py` files left out."""
    found = set()
    for path in (root / "moe_perf").rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_dir() and (path / "__init__.py").exists():
            found.add(rel)
        elif path.suffix == ".py" and path.name != "__init__.py":
            found.add(rel)
    return found | {"moe_perf"}


def layout_mismatch(root: Path) -> tuple[set[str], set[str]]:
    """(modules missing from design.md's layout, layout entries with no module)."""
    listed = layout_listing((root / "docs" / "design.md").read_text())
    present = package_modules(root)
    return present - listed, listed - present


PLANTED_LAYOUT = """# design

## Layout

```
conf/                      groups
moe_perf/
  app.py                   listed, present
  gone.py                  listed, absent
  sub/                     a package
    inner.py               listed, present
bench/ tests/
```
"""


def plant(tmp_path: Path) -> Path:
    """A small repository: a package, a README and one docs page, some names right, some wrong."""
    for module in ("moe_perf/app.py", "moe_perf/sub/__init__.py", "moe_perf/sub/inner.py",
                   "moe_perf/unlisted.py", "moe_perf/__init__.py", "bench/run.py"):  # fmt: skip
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    (tmp_path / "docs" / "design.md").write_text(PLANTED_LAYOUT)
    (tmp_path / "docs" / "benchmarks" / "page.md").write_text("# A page\n\n## On CPU\n")
    (tmp_path / "README.md").write_text(
        "[good](docs/benchmarks/page.md#on-cpu) [bad](docs/benchmarks.md)"
        " [bad anchor](docs/benchmarks/page.md#on-gpu) [web](https://example.com/x.md)"
        " ![picture](docs/missing.png) `[in code](nowhere.md)`\n"
        "See `moe_perf/app.py`, moe_perf/callback.py, `bench/run.py`, `bench/gone.sh`,\n"
        "~/.cache/moe_perf/pycache/x.py and <tree>/bench/other.sh.\n"
    )
    return tmp_path


def test_the_link_check_finds_a_planted_missing_file_and_heading_and_nothing_else(tmp_path):
    root = plant(tmp_path)
    assert broken_links(root / "README.md") == [
        "README.md: docs/benchmarks.md (no such file)",
        "README.md: docs/benchmarks/page.md#on-gpu (no such heading)",
        "README.md: docs/missing.png (no such file)",
    ]


def test_the_path_check_finds_planted_stale_module_and_script_names_and_nothing_else(tmp_path):
    root = plant(tmp_path)
    assert missing_paths(root / "README.md", root) == [
        "README.md: bench/gone.sh",
        "README.md: docs/benchmarks.md",
        "README.md: docs/missing.png",
        "README.md: moe_perf/callback.py",
    ]


def test_the_layout_check_finds_an_unlisted_module_and_a_listed_one_that_is_gone(tmp_path):
    root = plant(tmp_path)
    assert layout_mismatch(root) == ({"moe_perf/unlisted.py"}, {"moe_perf/gone.py"})


def test_anchors_follow_githubs_rule_for_punctuation_and_repeated_headings():
    text = "# An arm without torchrun (f2b70a0)\n## On CPU\n## On CPU\n```\n# not a heading\n```\n"
    assert anchors(text) == {"an-arm-without-torchrun-f2b70a0", "on-cpu", "on-cpu-1"}


def test_every_relative_link_in_the_readme_and_docs_exists():
    pages = [p for p in docs_of(ROOT) if p.suffix == ".md"]
    assert len(pages) >= 5, "the docs were not found"
    assert [b for page in pages for b in broken_links(page)] == []


def test_every_repository_path_named_in_the_readme_docs_and_config_exists():
    assert [m for page in docs_of(ROOT) for m in missing_paths(page, ROOT)] == []


def test_designs_layout_lists_every_module_under_moe_perf_and_only_those():
    unlisted, gone = layout_mismatch(ROOT)
    assert (sorted(unlisted), sorted(gone)) == ([], []), (
        "docs/design.md's Layout: add one line per new module, remove moved ones"
    )
