"""Log one finished arm to Weights & Biases, outside the timed region.

Interface for the runner (call it after the trainer processes have exited and metrics.json is
written, so wandb's start-up and network never touch a measured step)::

    from moe_perf.runner.wandb_log import log_arm
    run_dir = log_arm(record, arm_dir, wandb_cfg)   # -> str | None, never raises

* `record`: the arm's metrics.json dict (schema moe_perf.arm/2): model, tag, arm, repeat, sha,
  ref, status, steps, summary, environment, config.
* `arm_dir`: the arm's directory; wandb writes under `<arm_dir>/wandb/`.
* `wandb_cfg`: the config's `wandb` block (a dict or DictConfig): `mode` (`auto` | `online` |
  `offline` | `disabled`, default `auto`), `project` (default `moe_perf`), optional `entity`.
  `auto` is online when an API key is configured (WANDB_API_KEY, or a netrc entry for the
  wandb host) and the server (WANDB_BASE_URL) accepts a connection within a few seconds, and
  offline otherwise; `disabled` does nothing and does not import wandb.
* Returns the wandb run directory, or None when disabled or when wandb failed (a warning is
  printed: wandb trouble never fails an arm).

The run: group `performance/<model>` (all meshes of a model side by side, apart from
correctness runs), name `<tag>-<arm>` (`-r<k>` with repeats, as the arm directory), config =
the resolved config with secrets redacted, one wandb step per training step, and the arm's
summary (medians, step 1 and the settling steps dropped; whether the run settled) in the
run summary.
"""

from __future__ import annotations

import netrc
import os
import re
import socket
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

MODES = ("auto", "online", "offline", "disabled")
STEP_METRICS = ("step_time_s", "tokens_per_s", "peak_mem_gib", "loss", "tflops", "mfu")
SUMMARY_METRICS = ("steps_measured", "steps_settling", "settled", "step_time_s", "tokens_per_s",
                   "peak_mem_gib", "tflops", "mfu")  # fmt: skip
REDACTED = "<redacted>"
# Config keys whose values are never logged, whatever they hold.
_SECRET_KEY_RE = re.compile(r"(api_?key|token|secret|password)", re.IGNORECASE)


def _as_dict(cfg: Mapping | None) -> dict:
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):  # a DictConfig: plain containers from here on
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)


# wandb itself retries an unreachable server for about 90 s per run before it gives up
PROBE_TIMEOUT_S = 3.0


def _base_url() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")


def _wandb_host() -> str:
    return urlparse(_base_url()).hostname or "api.wandb.ai"


def server_reachable(base_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server accepts a TCP connection within `timeout_s`, name lookup included
    (which has no timeout of its own: it runs in a thread that is given up on)."""
    url = urlparse(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    reached: list[bool] = []

    def connect() -> None:
        try:
            with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
                reached.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, name="wandb-probe", daemon=True)
    probe.start()
    probe.join(timeout_s)
    return bool(reached)


def api_key() -> str | None:
    """The configured API key (env first, then netrc), or None. Only ever compared, never shown."""
    key = os.environ.get("WANDB_API_KEY")
    if key:
        return key
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(_wandb_host())
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry and entry[2] else None


def choose_mode(mode: str | None) -> tuple[str, str]:
    """(mode, why): `auto` is online with an API key and a reachable server, else offline;
    other modes as given."""
    mode = (mode or "auto").lower()
    if mode not in MODES:
        raise ValueError(f"wandb.mode={mode!r}: choose one of {', '.join(MODES)}")
    if mode != "auto":
        return mode, f"wandb.mode={mode}"
    if not api_key():
        return "offline", "wandb.mode=auto and no API key: WANDB_API_KEY or a netrc entry"
    if not server_reachable(_base_url()):
        return "offline", (f"wandb.mode=auto: {_base_url()} did not answer within "
                           f"{PROBE_TIMEOUT_S:g} s")  # fmt: skip
    return "online", "wandb.mode=auto and an API key is configured"


def resolve_mode(mode: str | None) -> str:
    """The mode wandb runs in (choose_mode without the reason)."""
    return choose_mode(mode)[0]


def redact(value, secrets: tuple[str, ...] = ()):
    """A copy of a config with secret-looking keys and any secret string replaced."""
    if isinstance(value, Mapping):
        return {
            k: REDACTED if _SECRET_KEY_RE.search(str(k)) and v else redact(v, secrets)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value


def run_name(record: dict, arm_dir: Path) -> str:
    """`<tag>-<arm>`, plus `-r<k>` where the arm directory carries a repeat index."""
    name = f"{record.get('tag')}-{record.get('arm')}"
    if arm_dir.name.startswith(name):
        return arm_dir.name  # the runner's own choice, repeat suffix included
    repeat = record.get("repeat") or 0
    return f"{name}-r{repeat}" if repeat else name


def _run_config(record: dict, secrets: tuple[str, ...]) -> dict:
    config = redact(record.get("config") or {}, secrets)
    config["moe_perf"] = redact(
        {k: record.get(k) for k in ("arm", "repeat", "ref", "sha", "status", "environment")},
        secrets,
    )
    return config


def _init(wandb, cfg: dict, mode: str, **run):
    """A wandb run of the configured project and entity. No console capture (the arm's log is
    already saved), no system sampling or code copy: a record of finished numbers, and
    nothing from the environment should leak."""
    settings = wandb.Settings(
        console="off", silent=True, save_code=False, x_disable_stats=True, disable_git=True
    )
    return wandb.init(project=cfg.get("project") or "moe_perf", entity=cfg.get("entity") or None,
                      mode=mode, settings=settings, **run)  # fmt: skip


def _log_run(record: dict, arm_dir: Path, cfg: dict, mode: str, why: str) -> str:
    import wandb  # here, not at module top: `disabled` must not even import it

    secrets = tuple(s for s in (api_key(),) if s)
    model = record.get("model", "unknown")
    run = _init(
        wandb,
        cfg,
        mode,
        group=f"performance/{model}",
        job_type="performance",
        name=run_name(record, arm_dir),
        tags=[str(model), str(record.get("tag")), str(record.get("arm"))],
        config=_run_config(record, secrets),
        dir=str(arm_dir),
    )
    try:
        for sample in record.get("steps") or []:
            metrics = {k: sample[k] for k in STEP_METRICS if sample.get(k) is not None}
            run.log(metrics, step=int(sample["step"]))
        summary = record.get("summary") or {}
        for key in SUMMARY_METRICS:
            if summary.get(key) is not None:
                run.summary[key] = summary[key]  # medians, not the last step's value
        run.summary["status"] = record.get("status")
        run_dir = Path(run.dir).parent
        where = run.url if mode == "online" else f"{run_dir} (upload later: wandb sync {run_dir})"
        print(f"[moe_perf] wandb {mode} ({why}): run {run.name}: {where}", flush=True)
        return str(run_dir)
    finally:
        run.finish(exit_code=0 if record.get("status") == "ok" else 1)


def log_arm(record: dict, arm_dir: Path | str, wandb_cfg: Mapping | None) -> str | None:
    """Log one finished arm; the wandb run directory, or None. Never raises."""
    arm_dir = Path(arm_dir)
    try:
        cfg = _as_dict(wandb_cfg)
        mode, why = choose_mode(cfg.get("mode"))
        if mode == "disabled":
            return None
        return _log_run(record, arm_dir, cfg, mode, why)
    except Exception as exc:  # wandb trouble must not fail an arm whose numbers are saved
        secrets = tuple(s for s in (api_key(),) if s)
        message = redact(f"{type(exc).__name__}: {exc}", secrets)
        print(
            f"[moe_perf] warning: wandb logging of {arm_dir.name} failed ({message}); "
            "the arm's results in metrics.json are unaffected",
            file=sys.stderr,
            flush=True,
        )
        return None


# ---- the verdict of a (model, tag), at the end of the sweep ----------------------------------

VERDICT_KEYS = ("word", "estimate", "low", "high", "pairs", "confidence", "effect", "reason")


def verdict_summary(group: dict) -> dict:
    """A comparison group's verdict as flat summary keys: `verdict/step_time_s/word`, ..."""
    summary = {"verdict/pairs": group.get("pairs"), "verdict/aa": group.get("aa")}
    for metric, verdict in (group.get("verdict") or {}).items():
        for key in VERDICT_KEYS:
            if verdict.get(key) is not None:
                summary[f"verdict/{metric}/{key}"] = verdict[key]
    return summary


def _log_verdict(group: dict, state_dir: Path, cfg: dict, mode: str, why: str) -> str:
    import wandb

    model, tag = group.get("model", "unknown"), group.get("tag")
    where = state_dir / "wandb-verdict" / f"{model}-{tag}"
    where.mkdir(parents=True, exist_ok=True)
    run = _init(
        wandb,
        cfg,
        mode,
        group=f"performance/{model}",  # beside the arms it decides on
        job_type="verdict",
        name=f"{tag}-verdict",
        tags=[str(model), str(tag), "verdict"],
        config={
            "plan": group.get("plan"),
            "shas": {a: v.get("shas") for a, v in group.get("arms", {}).items()},
        },  # fmt: skip
        dir=str(where),
    )
    try:
        for key, value in verdict_summary(group).items():
            run.summary[key] = value
        run_dir = Path(run.dir).parent
        shown = run.url if mode == "online" else f"{run_dir} (upload later: wandb sync {run_dir})"
        print(f"[moe_perf] wandb {mode} ({why}): verdict of {model} {tag}: {shown}", flush=True)
        return str(run_dir)
    finally:
        run.finish()


def log_verdict(group: dict, state_dir: Path | str, wandb_cfg: Mapping | None) -> str | None:
    """Log one (model, tag)'s verdict as a run of its own (job type `verdict`, in the arms'
    group) whose summary carries it; the run directory under `state_dir`, or None. Never
    raises: the comparison is already written."""
    try:
        cfg = _as_dict(wandb_cfg)
        mode, why = choose_mode(cfg.get("mode"))
        if mode == "disabled" or not group.get("verdict"):
            return None
        return _log_verdict(group, Path(state_dir), cfg, mode, why)
    except Exception as exc:
        secrets = tuple(s for s in (api_key(),) if s)
        message = redact(f"{type(exc).__name__}: {exc}", secrets)
        print(f"[moe_perf] warning: wandb logging of the verdict failed ({message}); "
              "comparison.json is unaffected", file=sys.stderr, flush=True)  # fmt: skip
        return None
