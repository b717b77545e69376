#!/usr/bin/env bash
# Make an arm for speedbench's A/B of Python environments (docs/outputs.md "A/B of
# environments"): a virtual environment at DIR with torch==VERSION and the light packages
# speedbench's worker imports (hydra-core, pandas, psutil, tqdm). speedbench itself comes from
# the running checkout (the worker runs with its source on PYTHONPATH), so it is not installed.
# uv where it is installed, else python -m venv and pip. Extra arguments go to the installer:
# torchvision and pillow for the ResNet and the VAE (their synthetic images; a torchvision
# built for that torch: the same index and CUDA/CPU build), --index-url ...
#
#   scripts/make-arm.sh /tmp/arm213 2.13.0
#   scripts/make-arm.sh /tmp/arm215 2.15.0 torchvision pillow   # pip picks the matching one
#   python -m speedbench '+arms={a: {python: python3}, b: {python: /tmp/arm213/bin/python}}'
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: scripts/make-arm.sh DIR TORCH_VERSION [more packages or installer options]" >&2
  exit 2
fi
dir=$1 version=$2
shift 2
python=${PYTHON:-python3}
deps=("torch==$version" "hydra-core>=1.3,<1.4" "pandas>=2.0" "psutil>=5.9" "tqdm>=4.60")
if command -v uv > /dev/null; then
  uv venv --python "$python" "$dir"
  uv pip install --python "$dir/bin/python" "${deps[@]}" "$@"
else
  "$python" -m venv "$dir"
  "$dir/bin/python" -m pip install "${deps[@]}" "$@"
fi
got=$("$dir/bin/python" -c 'import torch; print(torch.__version__)')
echo "arm ready: $dir/bin/python (torch $got)"
echo "A/B: python -m speedbench '+arms={a: {python: $(command -v "$python")}, b: {python: $dir/bin/python}}'"
