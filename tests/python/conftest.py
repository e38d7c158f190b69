"""Shared fixtures of the Python suite: the build's CLI, the source tree, a Redis server on a
free loopback port (started and stopped by the test), synthetic KV arrays."""

import os
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

SOURCE_DIR = os.environ.get("KVSERVE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
CLI = os.environ.get("KVSERVE_CLI", os.path.join(SOURCE_DIR, "build", "kvserve"))


@pytest.fixture(scope="session")
def cli():
    if not os.path.exists(CLI):
        pytest.fail(f"the kvserve CLI is not built at {CLI} (set KVSERVE_CLI)")
    return CLI


@pytest.fixture(scope="session")
def source_dir():
    return SOURCE_DIR


def run_cli(*args, check=True):
    r = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"kvserve {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def kv_array(n_layer=4, n_head_kv=2, n_token=64, head_dim=16, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_layer, 2, n_head_kv, n_token, head_dim)).astype(np.float32)
    x[:, 0] *= np.linspace(0.5, 4, head_dim, dtype=np.float32)  # channel outliers in K, as real models have
    return x.astype(dtype)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    folder = tempfile.mkdtemp(prefix="kvserve-redis-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start within 10 s")
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
