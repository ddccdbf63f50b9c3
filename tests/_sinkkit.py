"""Real destinations for the sink tests: an MLflow store and server, TensorBoard's reader.

No mocks: MLflow is a real SQLite store or a real ``mlflow server`` on 127.0.0.1, read
back through ``mlflow.MlflowClient``; TensorBoard files are read by TensorBoard's own
``EventAccumulator``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: How long an ``mlflow server`` may take to answer /health (it migrates its DB first).
SERVER_START_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real ``mlflow server`` in its own process group, so a kill takes all its workers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "server.log"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--backend-store-uri",
            f"sqlite:///{self.root / 'server.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--workers",
            "1",
        ]
        # No job runner: a second process the tests do not need, on a machine of 2 cores.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        deadline = time.monotonic() + SERVER_START_S
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mlflow server did not start in {SERVER_START_S} s")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole process group: the server dies mid-run, as a crash would."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None
        deadline = time.monotonic() + 10
        while self.healthy() and time.monotonic() < deadline:  # a worker may linger a moment
            time.sleep(0.1)


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A TCP port that accepts connections and never answers: the slowest server there is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(128)  # the kernel completes handshakes into the backlog; nobody reads
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def tb_scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every scalar under ``tag`` in an event file or log dir."""
    acc = _accumulator(path)
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_texts(path: Path, tag: str) -> list[tuple[int, str]]:
    """(step, text) of every text summary under ``tag``."""
    from tensorboard.util import tensor_util

    acc = _accumulator(path)
    if tag not in acc.Tags()["tensors"]:
        return []
    assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "text"
    return [
        (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode("utf-8"))
        for e in acc.Tensors(tag)
    ]


def _accumulator(path: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # purge_orphaned_data=False: keep every event as written; the default drops events
    # whose step goes backwards, which is TensorBoard's reading of a restarted run.
    acc = EventAccumulator(
        str(path), size_guidance={"scalars": 0, "tensors": 0}, purge_orphaned_data=False
    )
    acc.Reload()
    return acc
