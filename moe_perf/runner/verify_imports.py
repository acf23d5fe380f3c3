"""What an arm imports: for the trainer's own package and each module of
`trainer.verify_imports`, the file it is loaded from and a hash of it, for the record.

The modules are resolved by the arms' interpreter with the arm's own environment and working
directory (its worktree first on PYTHONPATH, the trainer's env), the way its `import` resolves
them, but without running any of their code: a top-level name through `sys.meta_path` (editable
installs' finders included), a dotted one through its parent's search locations. A module
found outside the worktree is the shared environment's copy, the same for both arms; when the
two commits' arms load the same file, the comparison says so (report/imports.py).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# Run by the arms' interpreter: [{module, origin, locations}] for the names in argv[1].
_PROBE = r"""
import importlib.util, json, sys

def find(name):
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for depth in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        fullname, where = ".".join(parts[: depth + 1]), list(spec.submodule_search_locations)
        spec = next((s for s in (f.find_spec(fullname, where) for f in sys.meta_path
                                 if hasattr(f, "find_spec")) if s is not None), None)
    return spec

found = []
for name in json.loads(sys.argv[1]):
    try:
        spec = find(name)
    except (ImportError, ValueError) as err:
        found.append({"module": name, "error": f"{type(err).__name__}: {err}"})
        continue
    if spec is None:
        found.append({"module": name, "error": "not found"})
        continue
    has_file = spec.origin not in (None, "built-in", "frozen", "namespace")
    found.append({"module": name, "origin": spec.origin if has_file else None,
                  "locations": list(spec.submodule_search_locations or [])})
print(json.dumps(found))
"""


def trainer_module(cfg: Any) -> str | None:
    """The trainer's own package, as a module name: `trainer.code_path` (moe_perf/trainer ->
    moe_perf.trainer), else the module of a `-m module` command; None for a script."""
    code_path = cfg.trainer.get("code_path")
    if code_path:
        return str(code_path).strip("/").removesuffix(".py").replace("/", ".")
    command = [str(part) for part in cfg.trainer.get("command") or []]
    if len(command) >= 2 and command[0] == "-m":
        return command[1]
    return None


def modules_to_verify(cfg: Any) -> list[tuple[str, str]]:
    """(module, why it is listed): the trainer's package first, then trainer.verify_imports."""
    listed = [(m, "trainer.verify_imports") for m in cfg.trainer.get("verify_imports") or []]
    own = trainer_module(cfg)
    own_entry = [(own, "trainer package")] if own else []
    return own_entry + [(str(m), why) for m, why in listed if str(m) != own]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_sha256(directory: Path) -> str:
    """One hash of a package directory: its files' relative paths and contents (bytecode
    caches left out: they differ with the interpreter, not with the code)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory)
        if "__pycache__" in relative.parts or path.suffix == ".pyc":
            continue
        digest.update(f"{relative}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def describe_found(found: dict, worktree: Path) -> dict:
    """The record's entry of one resolved module: its file, what was hashed, and whether it is
    the arm's own (in its worktree) or the shared environment's."""
    entry: dict = {"module": found["module"]}
    if "error" in found:
        return {**entry, "file": None, "sha256": None, "error": found["error"]}
    locations = [Path(p) for p in found.get("locations") or [] if Path(p).is_dir()]
    origin = Path(found["origin"]) if found.get("origin") else None
    if locations:  # a package: its whole directory is what the arm runs
        where, digest, hashed = locations[0], tree_sha256(locations[0]), "package directory"
    elif origin is not None and origin.is_file():
        where, digest, hashed = origin, file_sha256(origin), "file"
    else:
        return {**entry, "file": str(origin) if origin else None, "sha256": None,
                "error": "no file to hash"}  # fmt: skip
    return {**entry, "file": str(origin or where), "sha256": digest, "hashed": hashed,
            "in_worktree": _inside(where, worktree)}  # fmt: skip


def probe(cfg: Any, worktree: Path, env: dict[str, str],
          python: str = sys.executable) -> list[dict]:  # fmt: skip
    """The record's `imports`: each module to verify as the arm would load it. `env` is the
    arm's whole environment (PYTHONPATH with the worktree first)."""
    wanted = modules_to_verify(cfg)
    found = probe_modules([name for name, _ in wanted], worktree, env, python)
    return [{**entry, "listed_by": why} for entry, (_, why) in zip(found, wanted, strict=True)]


def probe_modules(names: list[str], worktree: Path, env: dict[str, str],
                  python: str = sys.executable) -> list[dict]:  # fmt: skip
    """`names` resolved by `python` with `env` in `worktree`, one entry each (describe_found)."""
    if not names:
        return []
    proc = subprocess.run([python, "-c", _PROBE, json.dumps(names)], cwd=worktree, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return [{"module": name, "file": None, "sha256": None,
                 "error": f"could not resolve: {why}"} for name in names]  # fmt: skip
    return [describe_found(found, worktree) for found in json.loads(proc.stdout)]


def warnings(imports: list[dict]) -> list[str]:
    """What the console says before the launch: a listed module that the arm would load from
    the shared environment, or not at all."""
    said = []
    for entry in imports:
        if entry["listed_by"] != "trainer.verify_imports":
            continue
        if entry.get("error"):
            said.append(f"{entry['module']} does not resolve in the arm's environment "
                        f"({entry['error']})")  # fmt: skip
        elif not entry.get("in_worktree"):
            said.append(f"{entry['module']} is loaded from {entry['file']}, outside the arm's "
                        f"worktree: the shared environment's copy, the same for every arm "
                        f"(build it in the worktree: docs/build.md)")  # fmt: skip
    return said
