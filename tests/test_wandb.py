"""wandb logging of an arm: a real offline run, `disabled`, mode resolution, never failing an arm.

Runs that touch wandb go through a subprocess with HOME and wandb's directories in tmp, so the
test sees every file wandb writes and nothing leaks into the user's own wandb settings.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moe_perf.report.record import summarize
from moe_perf.runner import wandb_log

FAKE_KEY = "local-5f0e7c1d9a8b4c3e2f1a0b9c8d7e6f5a4b3c2d1e"  # looks like a key, is not one

LOG_ARM = textwrap.dedent(
    """
    import json, sys
    from moe_perf.runner.wandb_log import log_arm
    record = json.load(open(sys.argv[1]))
    result = log_arm(record, sys.argv[2], json.loads(sys.argv[3]))
    print("RESULT", result)
    print("WANDB_IMPORTED", "wandb" in sys.modules)
    """
)


def arm_record() -> dict:
    steps = [
        {"step": k, "step_time_s": 0.5 if k > 1 else 2.0, "tokens_per_s": 1000.0,
         "peak_mem_gib": 1.5, "loss": 6.0 - 0.1 * k, "tflops": None, "mfu": None}
        for k in range(1, 6)
    ]  # fmt: skip
    return {
        "schema": "moe_perf.arm/1", "model": "tiny", "tag": "pp1-dp1-cp1-ep1-seq64-bf16",
        "arm": "feat", "repeat": 1, "ref": "feature", "sha": "e" * 40, "status": "ok",
        "steps": steps, "summary": summarize(steps), "environment": {"host": "h"},
        "config": {
            "model": {"name": "tiny"},
            "wandb": {"mode": "offline", "project": "moe_perf", "api_key": FAKE_KEY},
            "note": f"a string that quotes the key {FAKE_KEY}",
        },
    }  # fmt: skip


def run_log_arm(tmp_path: Path, arm_dir: Path, wandb_cfg: dict, **env) -> str:
    record_path = tmp_path / "record.json"
    record_path.write_text(json.dumps(arm_record()))
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")},
        "HOME": str(home),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        **env,
    }
    cmd = [sys.executable, "-c", LOG_ARM, str(record_path), str(arm_dir), json.dumps(wandb_cfg)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert FAKE_KEY not in result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_offline_run_writes_under_arm_dir_and_never_the_key(tmp_path):
    arm_dir = tmp_path / "pp1-dp1-cp1-ep1-seq64-bf16-feat-r1"
    arm_dir.mkdir()
    out = run_log_arm(tmp_path, arm_dir, {"mode": "offline"}, WANDB_API_KEY=FAKE_KEY)
    assert "(upload later: wandb sync " in out
    run_dir = Path(out.split("RESULT ")[1].split()[0])
    assert run_dir.parent == arm_dir / "wandb"
    (data,) = run_dir.glob("run-*.wandb")  # wandb's binary record log: look for our fields
    content = data.read_bytes()
    for expected in (b"performance/tiny", b"pp1-dp1-cp1-ep1-seq64-bf16-feat-r1", b"step_time_s"):
        assert expected in content
    files = [p for p in arm_dir.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert FAKE_KEY.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_disabled_creates_nothing_and_does_not_import_wandb(tmp_path):
    arm_dir = tmp_path / "arm"
    arm_dir.mkdir()
    out = run_log_arm(tmp_path, arm_dir, {"mode": "disabled"}, WANDB_API_KEY=FAKE_KEY)
    assert "RESULT None" in out and "WANDB_IMPORTED False" in out
    assert list(arm_dir.iterdir()) == []


def test_auto_mode_follows_the_configured_key(tmp_path, monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))  # a server that accepts connections
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text(f"machine 127.0.0.1\n  login user\n  password {FAKE_KEY}\n")
    netrc_file.chmod(0o600)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    assert wandb_log.resolve_mode("auto") == "offline"
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_log.resolve_mode("auto") == "online"
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert wandb_log.resolve_mode("auto") == "online"
    assert wandb_log.resolve_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="wandb.mode"):
        wandb_log.resolve_mode("sometimes")
    server.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.mark.slow
def test_auto_mode_with_an_unreachable_server_goes_offline_in_seconds(tmp_path):
    arm_dir = tmp_path / "pp1-dp1-cp1-ep1-seq64-bf16-feat-r1"
    arm_dir.mkdir()
    url = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    out = run_log_arm(tmp_path, arm_dir, {"mode": "auto"}, WANDB_API_KEY=FAKE_KEY,
                      WANDB_BASE_URL=url)  # fmt: skip
    took = time.monotonic() - start
    assert f"wandb offline (wandb.mode=auto: {url} did not answer within 3 s)" in out
    assert list((arm_dir / "wandb").glob("offline-run-*"))
    assert took < 30  # wandb alone retries an unreachable server for about 90 s


def test_redaction_and_run_name(tmp_path):
    record = arm_record()
    config = wandb_log.redact(record["config"], (FAKE_KEY,))
    assert config["wandb"]["api_key"] == wandb_log.REDACTED
    assert FAKE_KEY not in json.dumps(config)
    assert config["model"] == {"name": "tiny"}
    assert wandb_log.run_name(record, tmp_path / "x") == "pp1-dp1-cp1-ep1-seq64-bf16-feat-r1"
    arm_dir = tmp_path / "pp1-dp1-cp1-ep1-seq64-bf16-feat"
    assert wandb_log.run_name({**record, "repeat": 0}, arm_dir) == arm_dir.name


def test_wandb_failure_is_a_warning_not_an_error(tmp_path, capsys):
    result = wandb_log.log_arm(arm_record(), tmp_path, {"mode": "sometimes"})
    assert result is None
    err = capsys.readouterr().err
    assert "wandb logging of" in err and "unaffected" in err


LOG_VERDICT = textwrap.dedent(
    """
    import json, sys
    from moe_perf.runner.wandb_log import log_verdict
    print("RESULT", log_verdict(json.load(open(sys.argv[1])), sys.argv[2], json.loads(sys.argv[3])))
    """
)


@pytest.mark.slow
def test_the_verdict_is_a_run_whose_summary_carries_it(tmp_path):
    group = {
        "model": "tiny", "tag": "pp1-dp1-cp1-ep1-seq64-bf16", "aa": False, "pairs": 3,
        "plan": {"effect": 0.01, "confidence": 0.95, "max_pairs": 6, "sequential": True},
        "arms": {"base": {"shas": ["b" * 40]}, "feat": {"shas": ["f" * 40]}},
        "verdict": {"step_time_s": {"word": "DIFFERENT", "estimate": 0.021, "low": 0.016,
                                    "high": 0.026, "pairs": 3, "confidence": 0.95,
                                    "effect": 0.01, "reason": "the interval excludes zero"}},
    }  # fmt: skip
    (tmp_path / "group.json").write_text(json.dumps(group))
    state = tmp_path / "sweep" / ".moe_perf"
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / "config"),
               WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))  # fmt: skip
    cmd = [sys.executable, "-c", LOG_VERDICT, str(tmp_path / "group.json"), str(state),
           json.dumps({"mode": "offline"})]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "verdict of tiny pp1-dp1-cp1-ep1-seq64-bf16" in result.stdout
    run_dir = Path(result.stdout.split("RESULT ")[1].split()[0])
    assert run_dir.is_relative_to(state)
    (data,) = run_dir.glob("run-*.wandb")
    content = data.read_bytes()
    for expected in (b"verdict/step_time_s/word", b"DIFFERENT", b"verdict/step_time_s/low",
                     b"performance/tiny", b"pp1-dp1-cp1-ep1-seq64-bf16-verdict"):  # fmt: skip
        assert expected in content, expected
    assert wandb_log.verdict_summary(group)["verdict/step_time_s/high"] == 0.026
