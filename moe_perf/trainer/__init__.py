"""The reference MoE trainer: `python -m moe_perf.trainer <arm_dir>/config.yaml` (see train.py).

Torch only; no Hydra. Model code (model.py, moe.py) is single-device; all distribution is in
parallelize.py.
"""
