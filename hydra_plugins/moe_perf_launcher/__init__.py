"""moe_perf's Hydra launcher plugin (Hydra only instantiates launchers from `hydra_plugins`).

`hydra/launcher=moe_perf_slurm` (conf/hydra/launcher/moe_perf_slurm.yaml) selects
`sequential_slurm.SequentialSlurmLauncher`; it needs the `slurm` extra
(hydra-submitit-launcher). Without it this package imports nothing, so Hydra's plugin scan
stays quiet for every other command.
"""
