"""Start the processes of a tensor-parallel run, as ``torchrun --nproc-per-node N`` would, and end them together.

``spectool record --tp N`` re-runs itself N times through :func:`launch`. Each process gets
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; when one exits with an error the
others are stopped at once and that rank's exit code is returned, so a failure on one rank
never leaves the rest waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

CHILD_ENV = "SPECTOOL_TP_CHILD"  # set in the launched processes, so they do not launch again


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched() -> bool:
    """Whether this process is one of the ranks a launcher started: :func:`launch`, or torchrun
    (which sets RANK), so that ``torchrun ... spectool record --tp N`` runs as those ranks instead
    of starting N more processes per rank."""
    return os.environ.get(CHILD_ENV) == "1" or "RANK" in os.environ


def launch(cmd: list[str], nproc: int, poll_s: float = 0.05) -> int:
    """Run ``cmd`` as ``nproc`` ranks on this machine; 0 when every rank succeeded, else the first
    failing rank's exit code (after the other ranks are stopped)."""
    env = {**os.environ, CHILD_ENV: "1", "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"spectool: rank {rank} of {nproc} failed (exit {code}); stopping the other ranks",
                      file=sys.stderr)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
