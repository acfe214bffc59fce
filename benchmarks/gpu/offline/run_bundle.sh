#!/usr/bin/env bash
# On a GPU machine with no network (python3 there holds a CUDA torch and transformers): lay out what scripts/setup.sh
# would have installed, from the bundle make_bundle.sh wrote (this file sits in it, in the repository's root), run
# the GPU check and copy its summaries, the step logs and the versions used to $OUT. ONLY=step,step runs a subset.
set -uo pipefail
BUNDLE=$(cd "$(dirname "$0")" && pwd)
cd "$BUNDLE/.."
: "${OUT:?set OUT to the folder for the results}"
SITE=${SITE:-/tmp/site}
FASHION_DIR=${FASHION_DIR:-/usr/share/datasets/fashion-mnist}
PY=${PY:-python3}
mkdir -p "$FASHION_DIR" "$SITE" "$OUT"
cp "$BUNDLE"/fashion-mnist/* "$FASHION_DIR"/
cp -r "$BUNDLE"/site/* "$SITE"/
"$PY" - "$SITE" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
for half in Path(sys.argv[1]).glob("*/*/model.fp16.safetensors"):  # fp16 for a 64 MiB transfer; fp32 as shipped
    weights = load_file(half)
    save_file({k: v.float() if v.is_floating_point() else v for k, v in weights.items()},
              str(half.with_name("model.safetensors")), metadata={"format": "pt"})
PY
export PYTHONPATH=$PWD/src:$SITE HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
VERSIONS="^(torch|transformers|tokenizers|huggingface.hub|safetensors|accelerate|pytest|hypothesis|numpy|scikit.learn) "
"$PY" -m pip list 2>/dev/null | grep -iE "$VERSIONS" > "$OUT/pip.txt"
CHECK=${CHECK_DIR:-/tmp/gpucheck}
PYTHON=$PY timeout "${CHECK_TIMEOUT:-500}" bash scripts/gpu_check.sh "$CHECK" ${ONLY:+--only "$ONLY"} 2>&1 \
  | tee "$OUT/check.log"
cp "$CHECK"/summary.* "$OUT"/ 2>/dev/null
(cd "$CHECK" 2>/dev/null && find steps -type f -size -900k \( -name '*.txt' -o -name '*.json' -o -name '*.jsonl' \
  -o -name '*.log' -o -name '*.xml' -o -name '*.yaml' -o -name '*.md' \) | tar czf "$OUT/steps.tgz" -T -)
ls -la "$OUT"
