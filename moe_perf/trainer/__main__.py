"""`python -m moe_perf.trainer CONFIG.yaml [section.key=value ...]`, directly or under torchrun.

Leaves with os._exit after flushing: about 1 run in 6 under torchrun aborted at interpreter
exit after destroy_process_group() (SIGABRT, "terminate called without an active exception",
torch 2.13 with gloo) although its output was complete; os._exit removed it (0 in 12).
"""

import os
import sys

from moe_perf.trainer.train import main

if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
