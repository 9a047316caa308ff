"""Rollout workers never hang on Ray (issue 24): an address nobody answers fails within a bounded
time naming it, a malformed address is named with the accepted forms, and workers that ask for
resources the cluster lacks (``--rollout.workers.gpus 1`` without a GPU) fail before any actor starts,
saying what is missing. The unit tests use a stand-in for the ``ray`` module; the command-line tests
run ``flashrl train`` as a subprocess (with a timeout, stdin closed)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashrl.distributed.cluster import check_resources, connect, parse_address
from flashrl.errors import ConfigError, UnsupportedError

FLASHRL = Path(sys.executable).parent / "flashrl"
HAS_RAY = importlib.util.find_spec("ray") is not None


class FakeRay:
    def __init__(self, resources=None, init_error=None):
        self.resources, self.init_error, self.inits = resources or {}, init_error, []

    def init(self, address=None, **kwargs):
        self.inits.append(address)
        if self.init_error:
            raise self.init_error

    def cluster_resources(self):
        return self.resources


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("address", ["auto", "10.0.0.5:6379", "ray://head:10001", "[::1]:6379"])
def test_accepted_address_forms(address):
    parse_address(address)


@pytest.mark.parametrize("address", ["foo", "10.0.0.5", "host:port", "host:0", "host:70000", ":1"])
def test_malformed_address_names_it_and_the_accepted_forms(address):
    ray = FakeRay()
    with pytest.raises(
        ConfigError, match=rf"rollout.workers.address={address!r}.*allowed: 'auto', host:port"
    ):
        connect(ray, address, 600.0)
    assert ray.inits == []


def test_refused_address_fails_at_once_naming_it():
    ray, address = FakeRay(), f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(
        ConfigError, match=rf"rollout.workers.address='{address}': no Ray cluster answers"
    ):
        connect(ray, address, 600.0)
    assert time.monotonic() - start < 5 and ray.inits == []  # ray.init never ran


def test_silent_address_fails_within_the_timeout(monkeypatch):
    """A black-holed address: the probe gives up after the (configurable) timeout."""

    def black_hole(target, timeout):
        time.sleep(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", black_hole)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"'10.255.255.1:6379'.*no answer within 0.5 s"):
        connect(FakeRay(), "10.255.255.1:6379", 0.5)
    assert time.monotonic() - start < 3


def test_ray_connection_errors_are_named():
    ray = FakeRay(init_error=ConnectionError("Could not find any running Ray instance."))
    with pytest.raises(
        ConfigError, match=r"rollout.workers.address='auto': Ray could not join.*running"
    ):
        connect(ray, "auto", 600.0)
    local = FakeRay(init_error=ConnectionError("local start failed"))
    with pytest.raises(ConnectionError):  # starting a local Ray is not about an address
        connect(local, None, 600.0)


def test_missing_resources_are_named():
    ray = FakeRay({"CPU": 2.0})
    with pytest.raises(UnsupportedError, match=r"rollout.workers.gpus=1 needs 1 GPU\(s\).*has 0"):
        check_resources(ray, 1, 1.0, 1.0, None)
    with pytest.raises(
        UnsupportedError, match=r"rollout.workers.count=3 x rollout.workers.cpus=1 needs 3 CPU"
    ):
        check_resources(ray, 3, 1.0, 0.0, "10.0.0.5:6379")
    check_resources(ray, 2, 1.0, 0.0, None)
    check_resources(FakeRay({"CPU": 8.0, "GPU": 2.0}), 2, 2.0, 1.0, None)


def _train(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    out = tmp_path / "run"
    args = [str(FLASHRL), "train", "--run.steps", "1", "--run.output-dir", str(out), *flags]
    start = time.monotonic()
    result = subprocess.run(
        args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert not out.exists()  # refused before anything was written
    return result, time.monotonic() - start


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("flashrl train: error: "), result.stderr
    return errors[0]


@pytest.mark.skipif(not HAS_RAY, reason="ray is not installed")
def test_train_with_an_unreachable_workers_address_fails_naming_it(tmp_path):
    address = f"127.0.0.1:{_closed_port()}"
    result, seconds = _train(
        tmp_path, "--rollout.workers.count", "1", "--rollout.workers.address", address
    )
    assert f"rollout.workers.address='{address}'" in _one_line(result)
    assert seconds < 120  # was: retries for more than 120 s without a message


@pytest.mark.skipif(not HAS_RAY, reason="ray is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_train_with_worker_gpus_and_no_gpu_says_what_is_missing(tmp_path):
    result, seconds = _train(
        tmp_path, "--rollout.workers.count", "1", "--rollout.workers.gpus", "1"
    )
    line = _one_line(result)
    assert "rollout.workers.gpus=1 needs 1 GPU(s)" in line and "has 0" in line
    assert seconds < 120  # was: a silent wait of the worker timeout (600 s)
