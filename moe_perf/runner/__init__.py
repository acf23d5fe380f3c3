"""The runner: the Hydra app, the sweep session, one arm, the preflight checks, git."""
