"""A real single-node SLURM cluster for the tests: munged, slurmctld and slurmd started as plain
daemons (no systemd, no cgroups) with a private config, ports and state folder, and ended by the
PIDs this module recorded; nothing else on the machine is touched or stopped.

Needs root and Debian's `slurm-wlm` and `munge` (scripts/install-test-deps.sh installs them).
Where SLURM cannot start, `start()` returns the reason and the tests that need it are skipped
with that reason.

Accounting: submitit polls `sacct` to learn how a job ended; without slurmdbd, a shim on PATH
answers it from slurmctld's memory (a finished job stays there MinJobAge, 300 s), so that a job
that died without writing its result (scancel, a time limit) is seen rather than waited for.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
# Not SLURM's 6817/6818: a cluster the machine already runs keeps its ports
CTLD_PORT, SLURMD_PORT = 16817, 16818

SACCT_SHIM = """#!/bin/sh
# sacct stand-in: answers `sacct -o JobID,State,NodeList --parsable2 -j ID[,ID...]` via squeue
ids=""
while [ $# -gt 0 ]; do case "$1" in -j) ids=$2; shift ;; -j*) ids=${1#-j} ;; esac; shift; done
echo "JobID|State|NodeList"
exec squeue -h -t all ${ids:+-j "$ids"} -o '%i|%T|%N'
"""


@dataclass
class Cluster:
    state: Path  # config, logs, PIDs, the sacct shim
    env: dict  # what a client (sbatch, the speedbench command) needs: SLURM_CONF, PATH
    pids: dict = field(default_factory=dict)  # daemon -> PID, only those this module started

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace")
                                                       .splitlines()[-15:])
                         for p in sorted(self.state.glob("*.log")))


def missing() -> str | None:
    """Why SLURM cannot start here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a SLURM cluster needs root (slurmd starts jobs as their user)"
    needed = ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "srun"]
    absent = [b for b in needed if not _which(b)]
    if absent:
        return (f"SLURM is not installed ({', '.join(absent)} not found): "
                "scripts/install-test-deps.sh (apt-get install slurm-wlm munge)")
    try:
        socket.getaddrinfo(socket.gethostname().split(".")[0], None)
    except OSError:
        return "this host's name does not resolve (slurmctld and slurmd look it up)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name,) if
                                       p.exists()), None)


def start() -> Cluster | str:
    """Bring the cluster up and wait until its node is idle; the reason it could not, else
    (what was started is stopped again)."""
    why = missing()
    if why:
        return why
    state = Path(tempfile.mkdtemp(prefix="speedbench-slurm-"))
    state.chmod(0o755)  # munged runs as `munge` and must reach its socket folder
    cluster = Cluster(state, {"SLURM_CONF": str(state / "slurm.conf"),
                              "PATH": f"{state / 'bin'}{os.pathsep}{os.environ['PATH']}"})
    try:
        _start_munged(cluster)
        _write_config(cluster)
        for daemon in ("slurmctld", "slurmd"):
            _start_slurm_daemon(cluster, daemon)
        _wait(lambda: cluster.run("sinfo", "-h", "-o", "%t").stdout.strip() == "idle", 60,
              "the node did not become idle")
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logs = cluster.logs()
        stop(cluster)
        return f"SLURM did not start: {exc}\n{logs}"
    return cluster


def _start_munged(cluster: Cluster) -> None:
    sock_dir = cluster.state / "munge"
    sock_dir.mkdir()
    shutil.chown(sock_dir, "munge", "munge")
    sock_dir.chmod(0o755)
    pid_file = sock_dir / "munged.pid"
    munged = _which("munged")
    subprocess.run(["runuser", "-u", "munge", "--", munged, f"--socket={sock_dir}/munge.sock",
                    f"--pid-file={pid_file}", f"--seed-file={sock_dir}/munged.seed",
                    f"--log-file={sock_dir}/munged.log"],
                   check=True, capture_output=True, timeout=30)
    _wait(lambda: pid_file.is_file() and pid_file.read_text().strip(), 10, "munged wrote no PID")
    cluster.pids["munged"] = int(pid_file.read_text())


def _write_config(cluster: Cluster) -> None:
    state, host = cluster.state, socket.gethostname().split(".")[0]
    node = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True,
                          timeout=30, check=True).stdout.splitlines()[0]
    mem_mb = int(node.split("RealMemory=")[1].split()[0])
    node = node.replace(f"RealMemory={mem_mb}", f"RealMemory={max(mem_mb - 512, 1024)}")
    (state / "spool").mkdir()
    (state / "ctld").mkdir()
    (state / "bin").mkdir()
    (state / "bin" / "sacct").write_text(SACCT_SHIM)
    (state / "bin" / "sacct").chmod(0o755)
    (state / "slurm.conf").write_text(f"""\
ClusterName=speedbench-tests
SlurmctldHost={host}
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={state}/munge/munge.sock
CredType=cred/munge
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=10
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmdSpoolDir={state}/spool
StateSaveLocation={state}/ctld
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
{node} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")


def _start_slurm_daemon(cluster: Cluster, daemon: str) -> None:
    # -c: no state from an earlier cluster; both fork and write their PID file
    subprocess.run([_which(daemon), "-c", "-f", str(cluster.state / "slurm.conf")],
                   check=True, capture_output=True, timeout=30,
                   env={**os.environ, **cluster.env})
    pid_file = cluster.state / f"{daemon}.pid"
    _wait(lambda: pid_file.is_file() and pid_file.read_text().strip(), 30,
          f"{daemon} wrote no PID")
    cluster.pids[daemon] = int(pid_file.read_text())


def _wait(ready, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > end:
            raise RuntimeError(what)
        time.sleep(0.2)


def stop(cluster: Cluster) -> list[str]:
    """Cancel the cluster's jobs and end the daemons this module started, newest first, by
    PID (SIGTERM, SIGKILL after 10 s); what was ended, one line each."""
    if "slurmctld" in cluster.pids:
        ids = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
        if ids:
            cluster.run("scancel", *ids)
    said = []
    for daemon in reversed(DAEMONS):
        pid = cluster.pids.pop(daemon, None)
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            said.append(f"{daemon} ({pid}) had already ended")
            continue
        end = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        said.append(f"{daemon} ({pid}) ended")
    shutil.rmtree(cluster.state, ignore_errors=True)
    return said


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours (not reaped) counts as ended
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
