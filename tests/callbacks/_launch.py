"""Start the two ranks of a distributed test as a launcher would, and wait for them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

#: The mark of a test that starts ranks: they need torch.distributed with gloo.
needs_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    commands: list[tuple[list[str], dict[str, str]]], out: Path, timeout: float, *, who: str
) -> None:
    """Start each ``(command, environment)`` at once, its output in ``out/log{i}.txt``, and
    wait for all of them; fail the test with their logs if any fails or is still running
    after ``timeout`` seconds (then every one is killed: never a hang). ``who``: what the
    processes are, for the message ("ranks", "workers")."""
    procs = []
    for i, (cmd, env) in enumerate(commands):
        log = open(out / f"log{i}.txt", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()  # only the processes started here
                proc.wait()
            log.close()
    failed = [(i, p.returncode) for i, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join(
            f"--- {i}:\n" + (out / f"log{i}.txt").read_text()[-3000:] for i, _ in failed
        )
        pytest.fail(f"{who} failed or timed out after {timeout} s (index, code): {failed}\n{logs}")


def source_path() -> str:
    """A ``PYTHONPATH`` that finds this checkout's ``stethoscope`` and ``benchmarks``."""
    root = Path(__file__).resolve().parents[2]
    return os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")])


def run_ranks(
    worker: Path,
    out: Path,
    scenarios: tuple[str, ...],
    timeout: float,
    *,
    nodes: bool = False,
    world: int = 2,
) -> Path:
    """Run ``worker`` as ranks 0 to ``world - 1`` of one process group on this machine
    (the environment names each rank: ``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``, and ``STETHOSCOPE_TEST_WORLD`` the number of ranks), each through
    every scenario (see :func:`run_processes`). Returns ``out``, where they wrote.

    ``nodes``: each rank is the only process of a node of its own (``NODE_RANK`` 0 and 1,
    both ``LOCAL_RANK`` 0, ``STETHOSCOPE_TEST_NODES=2`` for the worker's Trainer), as a
    two-node run's ranks are."""
    port = _free_port()
    commands = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": source_path(),
            "LOCAL_RANK": "0" if nodes else str(rank),
            "NODE_RANK": str(rank) if nodes else "0",
            "STETHOSCOPE_TEST_NODES": "2" if nodes else "1",
            "STETHOSCOPE_TEST_WORLD": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        commands.append(([sys.executable, str(worker), str(out), *scenarios], env))
    run_processes(commands, out, timeout, who="ranks")
    return out
