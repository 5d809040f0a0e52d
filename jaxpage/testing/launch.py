"""Start a `jaxpage serve` subprocess and wait until its health says SERVING (test and benchmark tooling, not part
of the product package)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], log_path: str | os.PathLike, env: dict | None = None, root: str | os.PathLike = ROOT,
          **popen) -> subprocess.Popen:
    """Runs ``python ARGV...`` from the repository root (``root``: another checkout's) with its output in
    log_path (env: the environment, default this process's; the root goes first on its PYTHONPATH)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    log = open(log_path, "wb")
    try:
        return subprocess.Popen([sys.executable, *argv], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                **popen)
    finally:
        log.close()


def health_status(target: str, service: str = "", timeout: float = 2.0) -> int | None:
    """The server's health status, or None when it does not answer."""
    with grpc.insecure_channel(target) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=timeout).status
        except grpc.RpcError:
            return None


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 180.0, log_path=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before SERVING" + _tail(log_path))
        if health_status(target) == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.5)
    raise TimeoutError(f"server at {target} not SERVING after {timeout:.0f} s" + _tail(log_path))


def _tail(log_path) -> str:
    if log_path is None or not Path(log_path).exists():
        return ""
    return "\n--- server log (tail) ---\n" + Path(log_path).read_text(errors="replace")[-4000:]


def apply_quick(parser, args, quick: dict) -> None:
    """``--quick``: each option in ``quick`` that was left at its default takes the quick value instead."""
    defaults = {a.dest: a.default for a in parser._actions}
    for name, value in quick.items():
        if getattr(args, name) == defaults[name]:
            setattr(args, name, value)
