"""Shared test fixtures. Every model is built from a config with random weights: nothing is downloaded."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: inputs are fresh per test and reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
