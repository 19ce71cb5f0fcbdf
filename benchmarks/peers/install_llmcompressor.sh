#!/usr/bin/env bash
# Install llm-compressor into its own venv (never the project's .venv), once; later calls reuse it.
#   benchmarks/peers/install_llmcompressor.sh        -> .peers/llmcompressor/bin/python
# torch is installed first, pinned to the CPU build the project uses (the local mirror serves
# torch==2.13.0 as the CPU wheel), so llmcompressor's own torch requirement is already satisfied and
# pip does not pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${LLMCOMPRESSOR_VENV:-.peers/llmcompressor}
VERSION=${LLMCOMPRESSOR_VERSION:-0.14.*}
TORCH=${LLMCOMPRESSOR_TORCH:-2.13.0}
PYTHON=${LLMCOMPRESSOR_PYTHON:-python3}
if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "import llmcompressor" 2>/dev/null; then
  echo "llm-compressor already installed in $VENV"; exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "error: $PYTHON not found" >&2; exit 2; }
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH"
"$VENV/bin/python" -m pip install -q "llmcompressor==$VERSION" "torch==$TORCH"
"$VENV/bin/python" -c "import llmcompressor, compressed_tensors, torch, transformers; print('llm-compressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'installed in $VENV')"
