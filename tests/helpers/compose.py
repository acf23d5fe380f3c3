"""The package's Hydra config, composed in-process with overrides, as the command would."""

from __future__ import annotations

from hydra import compose, initialize_config_module


def composed(*overrides: str, hydra_config: bool = False):
    with initialize_config_module(config_module="moe_perf.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)
