import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")


def clean_env() -> dict[str, str]:
    """The environment for a fresh multi-process job: without the launch variables that in-process
    Lightning runs of this test session left in ``os.environ``."""
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith("PL_")}


def run_job(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python *args`` as a fresh multi-process job; its output is captured as text."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=clean_env()
    )
