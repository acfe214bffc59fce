"""The Python API: train from a config in a few lines, or use the pieces (blocks, freeze policy, partitioner) alone.

    .venv/bin/python examples/train_from_python.py
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from pipetransformer.config import load_config
from pipetransformer.freeze import make_policy
from pipetransformer.models import build_model
from pipetransformer.pipe import BlockState, Link, partition, profile_blocks
from pipetransformer.train import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_vit.yaml"
TINY_BERT = {"model_type": "bert", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4,
             "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 32}
BATCH, SEQ_LEN, FROZEN_LAYERS, STAGES = 4, 16, 2, 2

with tempfile.TemporaryDirectory() as run_dir:  # a whole run: config + overrides -> summary
    config = load_config(CONFIG, ["train.max_steps=4", f"run.dir={run_dir}"])
    summary = train(config)
    print(f"trained {summary['steps']} steps, eval accuracy {summary['eval_accuracy']:.3f}")

torch.manual_seed(0)
model = build_model("hf", num_labels=2, hf_config=TINY_BERT)  # any HF encoder as embeddings, layers, head
print("blocks:", model.block_names())
policy = make_policy("geometric", model.num_layers, interval=1, interval_unit="steps", alpha=0.5,
                     percentile=50.0, max_fraction=1.0, seed=0)
print("geometric policy freezes layers", sorted(policy.decide(step=1, epoch=0, epoch_end=False).frozen))
inputs = (torch.randint(0, TINY_BERT["vocab_size"], (BATCH, SEQ_LEN)), torch.ones(BATCH, SEQ_LEN, dtype=torch.long))
states = [BlockState.FROZEN if i <= FROZEN_LAYERS else BlockState.ACTIVE for i in range(len(model))]
split = partition(profile_blocks(model, inputs), states, STAGES, micro_batch_size=BATCH,
                  memory_budget_bytes=math.inf, link=Link(bandwidth_bytes_per_s=1e10))
print("stages (block ranges):", split.bounds)
