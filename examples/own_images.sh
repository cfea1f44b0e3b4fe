#!/usr/bin/env bash
# Your own images, end to end: a folder of labelled photos (torchvision's ImageFolder
# layout, train/<class>/<file>.png) becomes a shard data set, which ResPipe trains on
# with augmentation in the loader (random crop + flip + normalization, seeded per
# sample), a stage killed mid-run, and the report prints what happened.
#
#   bash examples/own_images.sh [WORK_DIR]     (default: a new temporary folder)
#
# The images are made here at run time: three classes of generated shapes (squares,
# discs, crosses) of random sizes, colours and positions, 64x64 PNGs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MPIRUN=${MPIRUN:-.venv/bin/mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1
WORK=${1:-$(mktemp -d -t own-images-XXXXXX)}
mkdir -p "$WORK"
echo "own_images: working in $WORK"

# 1. a folder of PNGs, one subfolder per class
"$PY" - "$WORK/photos" <<'PYEOF'
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

root = Path(sys.argv[1])
rng = np.random.default_rng(0)
for cls in ("square", "disc", "cross"):
    (root / cls).mkdir(parents=True, exist_ok=True)
    for i in range(120):
        img = Image.new("RGB", (64, 64), tuple(int(v) for v in rng.integers(0, 80, 3)))
        draw = ImageDraw.Draw(img)
        r = int(rng.integers(10, 22))
        cx, cy = (int(v) for v in rng.integers(r + 2, 62 - r, 2))
        colour = tuple(int(v) for v in rng.integers(140, 256, 3))
        if cls == "square":
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
        elif cls == "disc":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
        else:
            draw.rectangle([cx - r, cy - 3, cx + r, cy + 3], fill=colour)
            draw.rectangle([cx - 3, cy - r, cx + 3, cy + r], fill=colour)
        img.save(root / cls / f"{i:03d}.png")
print(f"own_images: made {3 * 120} PNGs in {root}")
PYEOF

# 2. into shards: 32x32 RGB, a stratified held-out fifth
"$PY" -m native.convert folder "$WORK/photos" "$WORK/shapes" --size 32 --holdout 0.2

# 3. ResPipe on 3 stages with a hot backup each, augmentation on, stage 1 killed in step 30
"$MPIRUN" --oversubscribe --with-ft ulfm -n 6 "$PY" -m mpipipe train \
    --config jobs/configs/respipe-digits.toml \
    --set "data.path=\"$WORK/shapes\"" --set model.name=vgg --set model.num_classes=3 \
    --set 'model.factory=""' --set run.steps=60 --set run.eval_every=20 --set 'pipeline.balance_by="time"' \
    --set 'data.augment=["random_crop:4", "hflip"]' \
    --set 'data.mean=[0.2, 0.2, 0.2]' --set 'data.std=[0.3, 0.3, 0.3]' \
    --set 'resilience.backups="all"' --set 'resilience.mode="hot"' \
    --set 'optim.name="adam"' --set optim.lr=0.002 --set 'optim.schedule="constant"' \
    --inject kill:stage=1:step=30 --log "$WORK/shapes.h5"

# 4. what happened
"$PY" -m mpipipe report "$WORK/shapes.h5" --out "$WORK/plots"
