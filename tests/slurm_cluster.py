"""A one-node SLURM cluster on loopback (slurmctld + slurmd, Debian's slurm-wlm) for the tests of SLURM jobs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ports import free_port

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")  # the job states after which a job does not run again

CONFIG = """\
ClusterName=varuna-tests
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job may start again cred_expire + 1 s after it ended (Slurm's default: 120 s).
AuthInfo=cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing_requirements() -> str | None:
    """Why a SLURM cluster cannot run here, or None."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): `apt-get install slurm-wlm`, as .ci/run does"
    if os.geteuid() != 0:
        return "the one-node SLURM cluster runs its daemons as root"
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"this host's name {socket.gethostname()!r} does not resolve (SLURM jobs find rank 0 by it)"
    return None


class SlurmCluster:
    """slurmctld and slurmd with their config, state and logs under ``root``; the node is this host with
    ``cpus`` CPUs (more than the machine has: the tests run more processes than cores)."""

    def __init__(self, root: Path, cpus: int = 8) -> None:
        self.root = root
        (root / "state").mkdir(parents=True)
        (root / "spool").mkdir()
        self.node = socket.gethostname()
        ports = {"ctld_port": free_port(), "slurmd_port": free_port()}
        self.conf = root / "slurm.conf"
        self.conf.write_text(CONFIG.format(root=root, node=self.node, cpus=cpus, **ports))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        self._run("slurmctld", "-i")  # -i: ignore state a previous run left
        self._run("slurmd")
        self.wait_for(lambda: "idle" in self._run("sinfo", "-h", "-o", "%t").stdout, 60, "the node to be idle")

    def stop(self) -> None:
        self._run("scancel", "--full", "--partition=debug", check=False)
        self._run("scontrol", "shutdown", check=False)
        for name in ("slurmctld", "slurmd"):
            pid_file = self.root / f"{name}.pid"
            deadline = time.monotonic() + 30
            while pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    def sbatch(self, command: str, *options: str, cwd: Path, env: dict[str, str]) -> str:
        """Submit ``command`` as a batch job (output in ``cwd/slurm-<id>.out``); return the job id."""
        output = ["--output", f"{cwd}/slurm-%j.out", "--open-mode=append"]
        return self._submit([*output, *options, f"--wrap={command}"], cwd, env)

    def sbatch_script(self, script: str, *args: str, cwd: str, output: Path, env: dict[str, str]) -> str:
        """Submit the job script ``script`` with ``args`` from ``cwd``, its output to ``output``; return the job id."""
        return self._submit(["--output", str(output), script, *args], cwd, env)

    def _submit(self, args: list[str], cwd: Path | str, env: dict[str, str]) -> str:
        submit_env = {**env, "SLURM_CONF": str(self.conf)}
        return self._run("sbatch", "--parsable", f"--chdir={cwd}", *args, env=submit_env).stdout.strip()

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as ``scontrol show job`` gives them (``JobState``, ``Restarts``...)."""
        fields = self._run("scontrol", "-o", "show", "job", job_id).stdout.split()
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def wait_until_ended(self, job_id: str, timeout: float) -> str:
        """Wait until the job has ended (a requeued job only after its next run); return its final state."""
        self.wait_for(lambda: self.job(job_id)["JobState"] in ENDED, timeout, f"job {job_id} to end")
        return self.job(job_id)["JobState"]

    def output(self, job_id: str, cwd: Path) -> str:
        path = cwd / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM: waited {timeout} s for {what}; slurmctld log:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        path = self.root / "slurmctld.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def _run(self, *command: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(command, capture_output=True, text=True, env=env or self.env, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}\n{self.log()}")
        return result
