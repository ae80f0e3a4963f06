import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")


def clean_env() -> dict[str, str]:
    """The environment for a fresh multi-process job: without the launch variables that in-process
    Lightning runs of this test session left in ``os.environ``."""
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith("PL_")}


def run_job(
    args: list[str], cwd: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python *args`` as a fresh multi-process job (with ``env`` added); its output is captured as text."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**clean_env(), **(env or {})},
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """An S3-compatible server (moto) on loopback for this test session; yields fsspec's s3 options."""
    server_module = pytest.importorskip("moto.server", reason="moto[server] is needed for the s3:// tests")
    pytest.importorskip("s3fs", reason="s3fs is needed for the s3:// tests")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    try:
        server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    except Exception as err:  # noqa: BLE001 - any failure to start means: no server, skip
        pytest.skip(f"the moto S3 server did not start: {err}")
    host, port = server.get_host_and_port()
    yield {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: dict[str, str], request: pytest.FixtureRequest) -> str:
    """A fresh bucket on the loopback S3 server; returns its ``s3://`` URL."""
    import s3fs

    name = "test-" + "".join(c for c in request.node.name.lower() if c.isalnum())[:40]
    s3fs.S3FileSystem(**s3_server).mkdir(name)
    return f"s3://{name}"


def s3_env(options: dict[str, str]) -> dict[str, str]:
    """fsspec's environment configuration for ``options``: how Lightning's own ModelCheckpoint finds the server."""
    return {f"FSSPEC_S3_{key.upper()}": value for key, value in options.items()}
