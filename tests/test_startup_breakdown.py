"""bench/startup_breakdown.py: one arm's wall split into the runner's, the trainer's start-up
spans, step 1 and the measured steps; sampled stacks sorted into categories; -X importtime's
tree of imports. Real sampled threads, a real interpreter's import times, and (slow) a real
arm through bench_startup.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moe_perf.trainer import stacks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import startup_breakdown  # noqa: E402

SLOW_IMPORT = "import time\nimport json\ntime.sleep({s})\n"


def test_sampled_imports_and_joins_go_to_their_categories(tmp_path, monkeypatch):
    (tmp_path / "slow_module_x.py").write_text(SLOW_IMPORT.format(s=0.3))
    monkeypatch.syspath_prepend(str(tmp_path))
    marks = {"main": 0.0}
    sampler = stacks.start(2, marks)
    import slow_module_x  # noqa: F401

    marks["process_group"] = 1.0
    worker = threading.Thread(target=time.sleep, args=(0.3,))
    worker.start()
    worker.join()
    sampler.stop()
    sampler.write(tmp_path / "stacks_rank0.txt")

    parts = startup_breakdown.stack_parts(tmp_path / "stacks_rank0.txt")
    assert list(parts) == ["since main", "since process_group"]  # in the timeline's order
    assert parts["since main"]["imports"] > 0.2
    assert parts["since process_group"]["thread joins"] > 0.2
    assert "imports" not in parts["since process_group"]


@pytest.mark.slow
def test_the_import_tree_of_a_real_interpreter(tmp_path):
    (tmp_path / "slow_module_y.py").write_text(SLOW_IMPORT.format(s=0.1))
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import slow_module_y"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    found = {t["module"]: t for t in startup_breakdown.imports(proc.stderr, top=3)}
    slow = found["slow_module_y"]
    assert 0.1 <= slow["s"] < 5
    assert [name for name, _ in slow["heaviest"]] == ["json"]  # time: built in, no line
    assert all(t["s"] >= 0.05 for t in found.values())


@pytest.mark.slow
def test_one_arm_through_bench_startup_adds_up_to_the_command(tmp_path):
    out = tmp_path / "startup"
    sets = [
        "model=tiny", "dtype=bf16", "training.sequence_length=64", "training.micro_batch=2",
        "training.max_steps=3", "trainer.compile=false", "trainer.sample_stacks_ms=5",
        "trainer.warm_attention=true", "trainer.command=[-X,importtime,-m,moe_perf.trainer]",
    ]  # fmt: skip
    bench = [sys.executable, str(ROOT / "bench" / "bench_startup.py"), str(out), "--runs", "1"]
    proc = subprocess.run([*bench, *(f"--set={s}" for s in sets)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    assert startup_breakdown.main([str(out / "run1"), "--json", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    command = json.loads((out / "startup.json").read_text())["runs"][0]["command_wall_s"]
    parts = dict(result["timeline_s"])
    assert sum(parts.values()) == pytest.approx(command, rel=0.01)
    assert all(s >= 0 for s in parts.values()), parts
    assert parts["trainer: interpreter and imports, to main"] > 0.2
    record = json.loads((out / "run1" / "metrics.json").read_text())
    assert parts["step 1"] == pytest.approx(record["steps"][0]["step_time_s"], abs=1e-3)
    sampled = result["stacks_s"]
    assert sum(sampled["step 1"].values()) == pytest.approx(parts["step 1"], rel=0.25, abs=0.05)
    assert sampled["since model_on_meta"]  # the model's materialisation, sampled
    assert result["imports_s"][0]["module"] == "moe_perf.trainer.train"
    assert any(name == "torch" for name, _ in result["imports_s"][0]["heaviest"])
    assert result["attention_warm_up"]["error"] is None
