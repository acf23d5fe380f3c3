"""The one error type of a setting that cannot run, shared by every part of moe_perf."""


class PrerequisiteError(ValueError):
    """A setting or repository state that cannot run; the message names what to change.

    Raised before anything launches; the command prints it as one line (no traceback) and
    exits with code 2.
    """
