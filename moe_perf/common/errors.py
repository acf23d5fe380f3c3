"""The one error type of a setting that cannot run, shared by every part of moe_perf."""


class PrerequisiteError(ValueError):
    """A setting or repository state that cannot run; the message names what to change.

    Raised before anything launches; the command prints it as one line (no traceback) and
    exits with code 2.
    """


# The command's exit codes (besides 0, every arm ok; 1, a config Hydra cannot compose; 130,
# interrupted), one home for the runner, its callback and `bisect`, which reads them.
REFUSED = 2  # a prerequisite failed before anything launched (a PrerequisiteError)
ARM_FAILED = 3  # the sweep ran and at least one arm failed
