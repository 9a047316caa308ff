"""Shared test fixtures. Every model is built from a config with random weights: nothing is downloaded."""

from __future__ import annotations

import importlib.util
import logging
import zlib

import pytest
import torch

# Tiny models run as fast on one thread, and one thread keeps timings stable when the machine is
# shared: with two threads on a busy 2-core box every parallel op waits for a borrowed core (10x).
torch.set_num_threads(1)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_TRL = HAS_VLLM and importlib.util.find_spec("trl") is not None
# Without vLLM the vllm suite is not collected at all (scripts/test.sh runs it in .venv-vllm), so
# the report shows no skipped tests that were never meant to run here; likewise the TRL tests
# without TRL + vLLM (.venv-trl).
collect_ignore_glob = ([] if HAS_VLLM else ["test_vllm_*.py"]) + (
    [] if HAS_TRL else ["test_trl_*.py"]
)


def pytest_report_header(config):
    lines = []
    if not HAS_VLLM:
        lines.append(
            "vllm is not installed: tests/test_vllm_*.py not collected (scripts/test.sh: .venv-vllm)"
        )
    if not HAS_TRL:
        lines.append(
            "trl + vllm are not installed: tests/test_trl_*.py not collected (scripts/test.sh: .venv-trl)"
        )
    return lines or None


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: inputs are fresh per test and reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Build-once tiny checkpoints: `tiny_models(family, **overrides)` returns a saved model dir."""
    from flashrl.testing import save_tiny_model

    cache: dict[tuple, object] = {}

    def build(family: str = "qwen2", seed: int = 0, **overrides):
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-{len(cache)}")
            cache[key] = save_tiny_model(path, family, seed=seed, **overrides)
        return cache[key]

    return build


@pytest.fixture
def flashrl_logger():
    """The `flashrl` logger, restored (handlers, level, propagate) after the test; also checks that
    the root logger's handlers and level are untouched."""
    logger, root = logging.getLogger("flashrl"), logging.getLogger()
    saved = (list(logger.handlers), logger.level, logger.propagate)
    root_saved = (list(root.handlers), root.level)
    yield logger
    for handler in logger.handlers:
        if handler not in saved[0]:
            handler.close()
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    assert (list(root.handlers), root.level) == root_saved, "the root logger was reconfigured"
