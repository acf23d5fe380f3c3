"""The package's import rules, read from the source (AST), and a proof that the check can fail.

Rules (docs/design.md, "Import rules"):
  * the trainer (moe_perf/trainer) imports only moe_perf.common, itself, torch, numpy, yaml and
    the standard library, plus optional extras imported where they are used: torchao (fp8),
    tokenizers (the corpus build command) and triton (a CUDA kernel, built on first use); never
    Hydra, OmegaConf, wandb or git; kernels.py (the trainer's Triton kernels) imports triton at
    module level and is itself imported only inside functions;
  * runner, report, logs, launchers, frameworks, common and the Hydra launcher plugin never
    import torch, neither at module level nor inside a function (moe_perf/titan_entry.py is an
    in-rank entry point: torch and torchtitan are its job);
  * common imports nothing else of moe_perf;
  * the statistics (moe_perf/stats) import only numpy, scipy, the standard library and
    themselves, at module level or inside a function: the runner, the report and the sweeper
    import them, so they stay pure (no Hydra, no torch, no files read through another package);
  * model code (the single-device model: model, attention, layers, moe, routing, experts,
    balance) never imports torch.distributed: collectives are injected by parallelize.py;
  * no import cycle among moe_perf's modules, counting imports inside functions too: one that
    runs later cannot deadlock an import, but it still ties the two modules into one (a
    function-level import is how a cycle hides, so it gets no pass). Imports under
    `if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRAINER_ALLOWED = ("moe_perf.common", "moe_perf.trainer", "torch", "numpy", "yaml")
TRAINER_OPTIONAL = ("torchao", "tokenizers", "triton")
OPTIONAL_MODULES = ("moe_perf.trainer.kernels",)  # may import an optional extra at module level
NO_TORCH_PACKAGES = (
    "moe_perf.runner",
    "moe_perf.report",
    "moe_perf.logs",
    "moe_perf.launchers",
    "moe_perf.frameworks",
    "moe_perf.common",
    "hydra_plugins",
)
NO_TORCH_EXEMPT = ("moe_perf.titan_entry",)
STATS_ALLOWED = ("moe_perf.stats", "numpy", "scipy")
TORCH_FAMILY = ("torch", "torchao", "torchtitan", "triton")
MODEL_CODE = tuple(
    f"moe_perf.trainer.{m}"
    for m in ("model", "attention", "layers", "moe", "routing", "experts", "balance")
)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports, dotted (a module, or a name in one)
    line: int
    top_level: bool  # runs when the module is imported (not inside a function)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every import statement of one file, with whether it runs at import time."""
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only: never executed
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, alias.name, child.lineno, top_level))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                if base == "__future__":
                    continue
                for alias in child.names:
                    found.append(Import(module, f"{base}.{alias.name}", child.lineno, top_level))
            else:
                visit(child, top_level)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _top(name: str) -> str:
    return name.split(".")[0]


def resolve(target: str, modules: set[str]) -> str | None:
    """The moe_perf module an import target loads: the longest known module prefix."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def violations(root: Path, packages=("moe_perf", "hydra_plugins")) -> list[str]:
    """Every broken rule under `root`, one line each (file:line: what and why)."""
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    modules = {module_name(root, p) for p in files}
    stdlib = set(sys.stdlib_module_names)
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules if _top(m) == "moe_perf"}

    for path in files:
        rel = path.relative_to(root)
        for imp in imports_of(root, path):
            m, t = imp.module, imp.target
            where = f"{rel}:{imp.line}: {m} imports {t}"
            if _under(m, ("moe_perf.trainer",)):
                allowed = _under(t, TRAINER_ALLOWED) or _top(t) in stdlib
                lazy = not imp.top_level or m in OPTIONAL_MODULES
                optional = lazy and _under(t, TRAINER_OPTIONAL)
                if not (allowed or optional):
                    problems.append(f"{where}: the trainer imports only common, itself, torch")
                if imp.top_level and _under(t, OPTIONAL_MODULES):
                    problems.append(f"{where}: an optional extra's module, imported where used")
            if (
                _under(m, NO_TORCH_PACKAGES)
                and not _under(m, NO_TORCH_EXEMPT)
                and _under(t, TORCH_FAMILY)
            ):
                problems.append(f"{where}: no torch outside the trainer")
            if _under(m, ("moe_perf.common",)) and _top(t) == "moe_perf":
                if not _under(t, ("moe_perf.common",)):
                    problems.append(f"{where}: common imports nothing else of moe_perf")
            if _under(m, ("moe_perf.stats",)):
                if not (_under(t, STATS_ALLOWED) or _top(t) in stdlib):
                    problems.append(f"{where}: stats imports only numpy, scipy and itself")
            if _under(m, MODEL_CODE) and _under(t, ("torch.distributed",)):
                problems.append(f"{where}: model code is single-device (parallelize.py injects)")
            if m in graph and (dep := resolve(t, modules)) and dep != m:
                if _top(dep) == "moe_perf":
                    graph[m].add(dep)

    if cycle := find_cycle(graph):
        problems.append(f"import cycle: {' -> '.join(cycle)}")
    return problems


# ---------------------------------------------------------------------------------------------


def test_the_package_keeps_its_import_rules():
    assert violations(ROOT) == []


def test_the_checker_sees_the_trainer_and_the_model_code():
    """The rules are applied to real files: a renamed package would pass vacuously."""
    names = {module_name(ROOT, p) for p in (ROOT / "moe_perf").rglob("*.py")}
    assert {"moe_perf.trainer.train", "moe_perf.trainer.moe", "moe_perf.runner.app"} <= names
    assert any(m in names for m in MODEL_CODE[1:])
    model_imports = {i.target for i in imports_of(ROOT, ROOT / "moe_perf/trainer/model.py")}
    assert any(t.startswith("torch") for t in model_imports)


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.relative_to(root).parents:
        init = root / parent / "__init__.py"
        if parent != Path(".") and not init.exists():
            init.write_text("")
    path.write_text(text)


def test_the_checker_reports_every_broken_rule(tmp_path):
    """A synthetic package that breaks each rule once: each break is reported, with its line."""
    write(tmp_path, "moe_perf/common/mesh.py", "from moe_perf.runner import app\n")
    write(tmp_path, "moe_perf/runner/app.py", "import os\n\ndef f():\n    import torch\n")
    write(tmp_path, "moe_perf/report/render.py", "from torch import nn\n")
    write(tmp_path, "moe_perf/titan_entry.py", "import torch\n")  # exempt
    write(tmp_path, "moe_perf/trainer/train.py", "import hydra\nimport torch\nimport numpy\n")
    write(tmp_path, "moe_perf/trainer/data.py", "def build():\n    import tokenizers\n")
    write(tmp_path, "moe_perf/trainer/kernels.py", "import triton\n")  # allowed there
    write(tmp_path, "moe_perf/trainer/loss.py", "from moe_perf.trainer import kernels\n")
    write(tmp_path, "moe_perf/trainer/moe.py", "import torch.distributed as dist\n")
    write(tmp_path, "moe_perf/trainer/routing.py", "from torch.distributed import all_reduce\n")
    write(tmp_path, "moe_perf/trainer/parallelize.py", "import torch.distributed\n")  # allowed
    write(tmp_path, "moe_perf/launchers/a.py", "from . import b\n")
    write(tmp_path, "moe_perf/launchers/b.py", "from moe_perf.launchers.c import X\n")
    write(tmp_path, "moe_perf/launchers/c.py", "from .a import *\n")
    write(tmp_path, "hydra_plugins/p/launcher.py", "import torch.cuda\n")
    write(tmp_path, "moe_perf/stats/verdict.py", "import math\nimport numpy\nimport scipy.stats\n")
    write(tmp_path, "moe_perf/stats/simulate.py", "from . import verdict\ndef f(): import hydra\n")
    write(tmp_path, "moe_perf/stats/plot.py", "from moe_perf.report import render\n")

    problems = violations(tmp_path)
    expected = [
        "moe_perf/common/mesh.py:1: moe_perf.common.mesh imports moe_perf.runner.app: common",
        "moe_perf/runner/app.py:4: moe_perf.runner.app imports torch: no torch",
        "moe_perf/report/render.py:1: moe_perf.report.render imports torch.nn: no torch",
        "moe_perf/trainer/train.py:1: moe_perf.trainer.train imports hydra: the trainer",
        "moe_perf/trainer/loss.py:1: moe_perf.trainer.loss imports moe_perf.trainer.kernels: an "
        "optional extra's module",
        "moe_perf/trainer/moe.py:1: moe_perf.trainer.moe imports torch.distributed: model code",
        "moe_perf/trainer/routing.py:1: moe_perf.trainer.routing imports "
        "torch.distributed.all_reduce: model code",
        "hydra_plugins/p/launcher.py:1: hydra_plugins.p.launcher imports torch.cuda: no torch",
        "moe_perf/stats/simulate.py:2: moe_perf.stats.simulate imports hydra: stats imports only",
        "moe_perf/stats/plot.py:1: moe_perf.stats.plot imports moe_perf.report.render: stats",
        "import cycle: moe_perf.launchers.a -> moe_perf.launchers.b -> moe_perf.launchers.c -> "
        "moe_perf.launchers.a",
    ]
    for line in expected:
        assert any(p.startswith(line) for p in problems), (line, problems)
    assert len(problems) == len(expected), problems


# ---- layers below the runner and the report --------------------------------------------------

# what each may import of moe_perf: log reading serves the launchers and the report, so it sits
# below both; the launchers are driven by the runner and feed the report, so they import neither
LOWER_LAYERS = {
    "moe_perf.logs": ("moe_perf.logs", "moe_perf.common"),
    "moe_perf.launchers": ("moe_perf.launchers", "moe_perf.logs", "moe_perf.common"),
}


def upward_imports(root: Path) -> list[str]:
    """Each import of a lower layer (LOWER_LAYERS) into a part of moe_perf above it."""
    found = []
    for package, allowed in LOWER_LAYERS.items():
        for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
            for imp in imports_of(root, path):
                if _top(imp.target) == "moe_perf" and not _under(imp.target, allowed):
                    found.append(f"{path.relative_to(root)}:{imp.line}: {imp.target}")
    return found


def test_the_layer_check_finds_a_planted_upward_import(tmp_path):
    write(tmp_path, "moe_perf/logs/reader.py", "from moe_perf.common import contract\n")
    write(tmp_path, "moe_perf/logs/bad.py", "def f():\n    from moe_perf.report import render\n")
    write(tmp_path, "moe_perf/launchers/process.py", "from moe_perf.logs import LogReader\n")
    write(tmp_path, "moe_perf/launchers/bad.py", "from moe_perf.runner.progress import x\n")
    assert upward_imports(tmp_path) == [
        "moe_perf/logs/bad.py:2: moe_perf.report.render",
        "moe_perf/launchers/bad.py:1: moe_perf.runner.progress.x",
    ]


def test_log_reading_and_the_launchers_import_nothing_above_them():
    assert upward_imports(ROOT) == []


def test_the_checker_finds_a_cycle_hidden_inside_a_function(tmp_path):
    """A module that reaches back to its importer from inside a function is a cycle still."""
    write(
        tmp_path,
        "moe_perf/runner/session.py",
        "def start():\n    from moe_perf.runner import app\n    return app.SESSION\n",
    )
    write(tmp_path, "moe_perf/runner/app.py", "from moe_perf.runner.session import start\n")
    assert violations(tmp_path) == [
        "import cycle: moe_perf.runner.app -> moe_perf.runner.session -> moe_perf.runner.app"
    ]
