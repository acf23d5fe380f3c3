"""Whether a build step changed the environment both arms share.

Both arms run one interpreter with one set of installed packages; only the worktree (first on
PYTHONPATH) is the arm's own. A build that installs into that shared environment (`pip install
-e .`, `pip install .`, `python setup.py develop`) makes every later arm, of either branch,
import the last build: the comparison then measures one branch twice and nothing says so.

A snapshot lists what the arms' interpreter finds outside the arm's own directories: every
installed distribution (name, version, where, and a digest of its RECORD and direct_url.json,
which change when it is reinstalled from other files or another checkout) and every `.pth`
file of the site directories (an editable install or `setup.py develop` adds one). It is taken
by that interpreter itself, with the runner's environment, so it sees what the arms see.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Run by the arms' interpreter: {key: digest} of the distributions on sys.path outside the
# excluded directories (the worktree, the arm directory), and of the site directories' .pth files.
_SNAPSHOT = r"""
import hashlib, importlib.metadata as md, json, os, site, sys
excluded = [os.path.realpath(p) for p in json.loads(sys.argv[1])]

def outside(path):
    path = os.path.realpath(path)
    return not any(path == e or path.startswith(e + os.sep) for e in excluded)

def digest(*texts):
    return hashlib.sha256("\0".join(t or "" for t in texts).encode()).hexdigest()[:16]

paths = [p for p in sys.path if p and os.path.isdir(p) and outside(p)]
found = {}
for dist in md.distributions(path=paths):
    where = str(getattr(dist, "_path", ""))
    name = dist.metadata["Name"] or "?"
    key = f"dist {name} {dist.version} {where}"
    found[key] = digest(dist.read_text("RECORD"), dist.read_text("direct_url.json"))
sites = site.getsitepackages() + [site.getusersitepackages()]
for directory in sorted({os.path.realpath(d) for d in sites if os.path.isdir(d)}):
    for name in sorted(os.listdir(directory)):
        if name.endswith(".pth"):
            with open(os.path.join(directory, name), errors="replace") as f:
                found[f"pth {os.path.join(directory, name)}"] = digest(f.read())
print(json.dumps(found))
"""


class SnapshotError(RuntimeError):
    """The interpreter could not list its environment; the message says why."""


def snapshot(env: dict[str, str], excluded: list[Path],
             python: str = sys.executable) -> dict[str, str]:  # fmt: skip
    """{what is installed: digest} as `python` sees it with `env`, outside `excluded`."""
    proc = subprocess.run(
        [python, "-c", _SNAPSHOT, json.dumps([str(p) for p in excluded])],
        env=env, cwd="/", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise SnapshotError(f"{python} could not list its installed packages: {why}")
    return json.loads(proc.stdout)


def _shown(key: str) -> str:
    kind, _, rest = key.partition(" ")
    if kind == "pth":
        return f"the path file {rest}"
    name, version, where = (rest.split(" ", 2) + ["", ""])[:3]
    return f"{name} {version} ({where})"


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What differs, in words: `installed`, `removed` or `changed`, one entry each."""
    found = [f"installed {_shown(k)}" for k in sorted(after.keys() - before.keys())]
    found += [f"removed {_shown(k)}" for k in sorted(before.keys() - after.keys())]
    found += [f"changed {_shown(k)}" for k in sorted(before.keys() & after.keys())
              if before[k] != after[k]]  # fmt: skip
    return found


def refusal(changed: list[str], python: str = sys.executable) -> str:
    """Why the arm is refused and what to do, in one line."""
    shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
    installed = sorted({c.split()[1] for c in changed if c.startswith("installed ")
                        and "path file" not in c})  # fmt: skip
    undo = f"`{python} -m pip uninstall {' '.join(installed)}`" if installed else "reinstall it"
    return (
        f"the build changed the environment both arms share ({shown}): every later arm, of "
        f"either branch, would import what it installed. Restore the environment ({undo}), "
        f"then build in place (trainer.build=[python,setup.py,build_ext,--inplace]) or into "
        f"the arm's own prefix ('trainer.build=[python,-m,pip,install,--no-deps,--target,"
        f'"{{worktree}}/.build",.]\' with \'+trainer.env.PYTHONPATH="{{worktree}}/.build"\'); '
        f"docs/build.md"
    )
