"""jaxpage behind an existing router: two `jaxpage serve` processes behind vllm-router (PyPI's `vllm-router`, its
cache_aware policy), requests through the router answered with the tokens a worker gives directly.

vllm-router is a test dependency (the test extras; a server of its own, never imported): found beside this
Python, on PATH, or at VLLM_ROUTER; skipped where it is not installed. The README's "Behind a router" section says
how to run jaxpage behind it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from jaxpage.testing.launch import free_port, spawn, wait_serving
from tests.factories import engine_options, save_word_tokenizer, tiny_llama
from tests.reference import save_random_model

ROUTER = (os.environ.get("VLLM_ROUTER") or shutil.which("vllm-router", path=os.path.dirname(sys.executable))
          or shutil.which("vllm-router"))
pytestmark = pytest.mark.skipif(not ROUTER, reason="vllm-router is not installed (set VLLM_ROUTER to its path)")
OPTIONS = engine_options(num_kv_blocks=40, max_model_len=96)
PROMPTS = ["t5 t9 t17 t33 t2 t8 t100 t77 t31 t64 t12 t3 t90 t45 t11 t7 t1 t60", "t200 t4 t6", "t5 t9 t17 t33 t2"]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def completion(port: int, prompt: str) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    return post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]["token_ids"]


def served(port: int) -> float:
    """Requests a worker finished, from its /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("jaxpage:e2e_request_latency_seconds_count"))


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    raise TimeoutError(url)


def test_two_jaxpage_servers_behind_vllm_router_answer_through_it(tmp_path):
    save_random_model(tiny_llama(), tmp_path / "llama", seed=5)
    save_word_tokenizer(tmp_path / "llama", 256)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items() if k != "progress"]
    procs, http_ports = [], []
    try:
        for i in range(2):
            port, http_port = free_port(), free_port()
            procs.append(spawn(["-m", "serving.cli", "serve", "--model", str(tmp_path / "llama"), "--port", str(port),
                                "--http-port", str(http_port), "--metrics-port", "0", "--served-model-name", "tiny",
                                "--cache-dir", str(tmp_path / "cache"), "--no-progress", *flags], tmp_path / f"worker{i}.log"))
            wait_serving(f"127.0.0.1:{port}", procs[-1], 300, tmp_path / f"worker{i}.log")
            http_ports.append(http_port)
        direct = [completion(http_ports[0], p) for p in PROMPTS]
        before = [served(p) for p in http_ports]
        router_port = free_port()
        with open(tmp_path / "router.log", "wb") as log:
            procs.append(subprocess.Popen(
                [ROUTER, "--host", "127.0.0.1", "--port", str(router_port), "--policy", "cache_aware",
                 "--worker-urls", *(f"http://127.0.0.1:{p}" for p in http_ports),
                 "--worker-startup-check-interval", "1"], stdout=log, stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{router_port}/health", procs[-1])
        through = [completion(router_port, p) for p in PROMPTS]
        assert through == direct
        after = [served(p) for p in http_ports]
        assert sum(after) - sum(before) == len(PROMPTS)  # each served once, by one of the workers
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
