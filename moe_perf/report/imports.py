"""Whether the arms of a comparison ran their own code: the records' `imports` side by side.

Each arm's record names, for the trainer's package and each module of `trainer.verify_imports`,
the file the arm loads and its hash (runner/verify_imports.py). Base and feat are different
commits; when both loaded one and the same file, what the feature branch changed in that module
was never measured (the shared environment's copy served both arms), and the comparison says so
first. A listed module whose two files are byte-identical is said too: the branch does not
change it, or its build did not reach the arm.
"""

from __future__ import annotations

from collections.abc import Iterable

from moe_perf.report.results.arm import ArmRecord


def _entries(records: Iterable[ArmRecord], arm: str) -> dict[str, list[dict]]:
    """{module: its entries over the arm's records}."""
    found: dict[str, list[dict]] = {}
    for record in records:
        if record.arm == arm:
            for entry in record.imports:
                found.setdefault(entry["module"], []).append(entry)
    return found


def _commits(records: Iterable[ArmRecord], arm: str) -> set[str]:
    return {r.sha for r in records if r.arm == arm and r.sha}


def import_warnings(records: list[ArmRecord]) -> list[str]:
    """One sentence per module that base and feat, different commits, loaded from the same
    file, or (a listed module) from files of the same content."""
    base_commits, feat_commits = _commits(records, "base"), _commits(records, "feat")
    if not base_commits or not feat_commits or base_commits == feat_commits:
        return []  # one commit (A/A): the same files are expected
    base, feat = _entries(records, "base"), _entries(records, "feat")
    said = []
    for module in sorted(base.keys() & feat.keys()):
        files = {e["file"] for e in base[module] if e.get("file")}
        shared = files & {e["file"] for e in feat[module] if e.get("file")}
        if shared:
            said.append(f"base and feat, two commits, both loaded {module} from {min(shared)}: "
                        f"what the feature branch changes in it was not measured")  # fmt: skip
            continue
        listed = any(e["listed_by"] == "trainer.verify_imports" for e in base[module])
        hashes = {e.get("sha256") for e in base[module] + feat[module]}
        if listed and len(hashes) == 1 and None not in hashes:
            said.append(f"{module} is byte-identical in base and feat (sha256 "
                        f"{hashes.pop()[:12]}): the branch does not change it, or its build did "
                        f"not reach the arm")  # fmt: skip
    return said
