"""`python -m moe_perf.trainer CONFIG.yaml [section.key=value ...]`, directly or under torchrun.

Leaves with os._exit after flushing: about 1 run in 6 under torchrun aborted at interpreter
exit after destroy_process_group() (SIGABRT, "terminate called without an active exception",
torch 2.13 with gloo) although its output was complete; os._exit removed it (0 in 12).
"""

import os
import sys

from moe_perf.trainer import early

if __name__ == "__main__":
    # before train's imports (dynamo's among them), so the context overlaps them
    context = early.start(sys.argv[1:])
    from moe_perf.trainer.train import main

    rc = main(sys.argv[1:], early_context=context)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
