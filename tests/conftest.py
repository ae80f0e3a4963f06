import contextlib
import json
import logging
import os
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# A job that times out is stopped with SIGABRT (`JobTimedOut`): no core files from its processes.
resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
from ports import free_port  # noqa: E402
from slurm_cluster import SlurmCluster, missing_requirements  # noqa: E402

_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")
# Azurite's local-only development account, published in its documentation (not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# Where .ci/run installs Azurite (npm --prefix .ci/node).
_LOCAL_AZURITE = Path(__file__).resolve().parents[1] / ".ci" / "node" / "node_modules" / ".bin" / "azurite-blob"
_FORKED_RANKS = str(Path(__file__).with_name("forked_ranks.py"))


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its own folder: what Lightning writes by default (``lightning_logs/``, checkpoints) lands
    there, not in the repository."""
    monkeypatch.chdir(tmp_path)


def clean_env() -> dict[str, str]:
    """The environment for a fresh multi-process job: without the launch variables that in-process
    Lightning runs of this test session left in ``os.environ``; with Python's fault handler on, so that a job that
    times out is stopped with SIGABRT and each of its Pythons writes where it was (`JobTimedOut`)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith("PL_")}
    return {**env, "PYTHONFAULTHANDLER": "1"}


class JobTimedOut(AssertionError):
    """A test job that did not end in time: the message has the end of its output, where each of its Pythons was
    when it was stopped included."""

    def __init__(self, args: list[str], timeout: float, stdout: str, stderr: str) -> None:
        stderr = re.sub(r"\nExtension modules: [^\n]*", "", stderr)  # the fault handler's list of them, long
        super().__init__(
            f"{' '.join(args)} did not end within {timeout} s; stopped with SIGABRT.\n"
            f"--- stdout (end) ---\n{stdout[-3000:]}\n--- stderr (end: each Python's threads) ---\n{stderr[-12000:]}"
        )


def run_job(
    args: list[str], cwd: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python *args`` as a fresh multi-process job (with ``env`` added); its output is captured as text. The
    job runs in a process group of its own, stopped when the job ends, times out or the test is interrupted, so
    that a hung rank does not hold a core and a port for the rest of the suite (torchrun, stopped by SIGTERM,
    stops its workers, which run in groups of their own). A script without an ``env`` of its own runs in a fork of
    this session's `preloaded_jobs` server, which has imported torch and Lightning; the processes it starts (as
    Lightning's launcher does) are fresh Pythons."""
    if not env and args[0].endswith(".py"):  # a script, forked from the server that has imported the libraries
        return _PRELOADED_JOBS.run(args, cwd, timeout, ranks=False)
    command = [sys.executable, *args]
    env = {**clean_env(), **(env or {})}
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env, start_new_session=True
    )
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _abort_with_descendants(job.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            stdout, stderr = job.communicate(timeout=10)
            raise JobTimedOut(command, timeout, stdout, stderr) from None
        raise
    finally:
        _stop_process_group(job)
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def _abort_with_descendants(root: int) -> None:
    """SIGABRT to ``root`` and every process it started, those in sessions of their own too (torchrun's workers):
    each Python among them writes where its threads were (its fault handler) and ends."""
    tree, unvisited = [], [root]
    while unvisited:
        pid = unvisited.pop()
        tree.append(pid)
        unvisited += children_of(pid)
    for pid in reversed(tree):  # the children first, one at a time: their stacks are not written into each other's
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        _until_ended(pid, timeout=2.0)


def children_of(pid: int) -> list[int]:
    """The processes that any thread of process ``pid`` started (none if it has ended)."""
    children: list[int] = []
    with contextlib.suppress(OSError):  # it ended meanwhile
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += map(int, (task / "children").read_text().split())
    return children


def _until_ended(pid: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for process ``pid`` to end (to be gone, or a zombie)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)


def _stop_process_group(job: subprocess.Popen) -> None:
    """SIGTERM to ``job``'s process group, 5 s for the job to end, then SIGKILL to what is left of the group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.communicate(timeout=5)  # closes the pipes (a process outside the group may still hold them)


def run_ranks(
    args: list[str],
    processes: int,
    cwd: Path,
    devices_per_node: int | None = None,
    timeout: int = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run the script ``args`` as a job of ``processes`` ranks, each a process forked from one Python that imported
    the libraries once (`forked_ranks`, itself forked from this session's `preloaded_jobs` server): Lightning runs
    them as processes another launcher started, without each paying for the imports. For the tests where how the
    processes start is not the point. A job with an ``env`` of its own starts from a fresh Python, since some
    libraries read the environment as they are imported (fsspec's ``FSSPEC_*`` options)."""
    launch = [str(processes), str(devices_per_node or processes), *args]
    if env:
        return run_job([_FORKED_RANKS, *launch], cwd, timeout=timeout, env=env)
    return _PRELOADED_JOBS.run(launch, cwd, timeout, ranks=True)


class _PreloadedJobs:
    """This session's `preloaded_jobs` server, started at its first job and restarted if it died."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None

    def run(self, args: list[str], cwd: Path, timeout: int, ranks: bool) -> subprocess.CompletedProcess:
        """Run ``python forked_ranks.py ARGS`` (``ranks``) or ``python ARGS`` in ``cwd`` as `run_job` does: in a
        process group of its own, stopped when the job ends, times out (`subprocess.TimeoutExpired`) or the test is
        interrupted; its output as text."""
        server = self._running()
        command = [_FORKED_RANKS, *args] if ranks else args
        with tempfile.TemporaryDirectory() as outputs:
            stdout, stderr = Path(outputs, "stdout"), Path(outputs, "stderr")
            output = {"stdout": str(stdout), "stderr": str(stderr)}
            request = {"ranks": ranks, "args": args, "cwd": str(cwd), "env": clean_env(), **output}
            print(json.dumps(request), file=server.stdin, flush=True)
            job = int(self._reply(server, 60) or "0")
            assert job, "the job server did not start the job within 60 s"
            status = None
            try:
                status = self._reply(server, timeout)
                if status is None:
                    _abort_with_descendants(job)
                    status = self._reply(server, 10)
                    raise JobTimedOut(command, timeout, stdout.read_text(), stderr.read_text())
            finally:
                self._stop(server, job, ended=status is not None)
            return subprocess.CompletedProcess(command, int(status), stdout.read_text(), stderr.read_text())

    def _running(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            server = str(Path(__file__).with_name("preloaded_jobs.py"))
            self._server = subprocess.Popen(
                [sys.executable, server], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env()
            )
        return self._server

    @staticmethod
    def _reply(server: subprocess.Popen, timeout: float) -> str | None:
        """The server's next reply, or None after ``timeout`` seconds."""
        assert server.stdout is not None
        if not select.select([server.stdout], [], [], timeout)[0]:
            return None
        reply = server.stdout.readline()
        assert reply, f"the job server ended (exit status {server.wait()})"
        return reply

    def _stop(self, server: subprocess.Popen, job: int, ended: bool) -> None:
        """SIGTERM to the job's process group (what an ended job left running, or the job), 5 s for a job that runs
        to end, then SIGKILL; a server that does not report the end of the job is stopped too."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job, signal.SIGTERM)
        if ended:
            return
        if self._reply(server, 5) is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job, signal.SIGKILL)
            if self._reply(server, 10) is None:
                server.kill()


_PRELOADED_JOBS = _PreloadedJobs()


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


def fsspec_env(protocol: str, options: dict[str, str]) -> dict[str, str]:
    """fsspec's environment configuration for ``options``: how Lightning's own ModelCheckpoint finds the server."""
    return {f"FSSPEC_{protocol.upper()}_{key.upper()}": value for key, value in options.items()}


def azurite_command() -> str | None:
    """Azurite's blob server: the one .ci/run installs into .ci/node, else one on PATH."""
    return str(_LOCAL_AZURITE) if _LOCAL_AZURITE.exists() else shutil.which("azurite-blob")


def azurite_connection_string(port: int) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
    )


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """An Azure Blob Storage server (Azurite, in memory) on loopback for this test session; yields adlfs's options."""
    pytest.importorskip("adlfs", reason="adlfs is needed for the az:// tests")
    command = azurite_command()
    if command is None:
        pytest.skip("Azurite is needed for the az:// tests: run .ci/run, or `npm install -g azurite`")
    workspace = tmp_path_factory.mktemp("azurite")
    port = free_port()
    flags = ["--inMemoryPersistence", "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]
    with open(workspace / "azurite.log", "wb") as log:
        server = subprocess.Popen(
            [command, "--blobHost", "127.0.0.1", "--blobPort", str(port), *flags],
            cwd=workspace,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while server.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        server.kill()
        server.wait()
        output = (workspace / "azurite.log").read_text(errors="replace")[-2000:]
        pytest.skip(f"the Azurite server did not start (exit code {server.returncode}): {output}")
    yield {"connection_string": azurite_connection_string(port)}
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture
def azure_container(azure_server: dict[str, str], request: pytest.FixtureRequest) -> str:
    """A fresh container on the loopback Azurite server; returns its ``az://`` URL."""
    import adlfs

    name = "test-" + "".join(c for c in request.node.name.lower() if c.isalnum())[:40] + f"-{uuid.uuid4().hex[:8]}"
    adlfs.AzureBlobFileSystem(**azure_server).mkdir(name)
    return f"az://{name}"


@dataclass(frozen=True)
class ObjectStore:
    """A fresh bucket or container on a loopback server: its URL and its fsspec options."""

    url: str
    options: dict[str, str]

    @property
    def env(self) -> dict[str, str]:
        """The options as fsspec's environment configuration, for code that passes none (Lightning's callbacks)."""
        return fsspec_env(self.url.split("://")[0], self.options)


@pytest.fixture(params=["s3", "az"])
def object_store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each blob store in turn: S3 (moto) and Azure Blob Storage (Azurite)."""
    server, container = {"s3": ("s3_server", "s3_bucket"), "az": ("azure_server", "azure_container")}[request.param]
    return ObjectStore(request.getfixturevalue(container), request.getfixturevalue(server))


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A one-node SLURM cluster on loopback for this test session (slurmctld + slurmd, no accounting)."""
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n``) the tests of the one SLURM cluster run in one worker (``--dist loadgroup``), and
    the longest work is handed out first: the SLURM tests (one unit of minutes), then the other slow tests, then the
    quick ones, which even out the workers' ends (in file order, a slow test handed out last kept one worker busy
    while the other had nothing left)."""
    for item in items:
        if "slurm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
    items.sort(
        key=lambda item: ("slurm" not in getattr(item, "fixturenames", ()), item.get_closest_marker("slow") is None)
    )
