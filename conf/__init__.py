"""moe_perf's Hydra configuration, shipped as the package `moe_perf.conf`.

Importing it registers the schema and the resolvers (`moe_perf.tag`, ...), so
`hydra.initialize_config_module("moe_perf.conf")` composes the same config as the command.
"""

import moe_perf.runner.schema  # noqa: F401  (registers on import)
