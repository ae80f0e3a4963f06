import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")


def clean_env() -> dict[str, str]:
    """The environment for a fresh multi-process job: without the launch variables that in-process
    Lightning runs of this test session left in ``os.environ``."""
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith("PL_")}
