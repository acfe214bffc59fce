"""AutoFreeze inside the Hugging Face Trainer (needs `pip install pipetransformer[hf]`): MiniLM on Rotten Tomatoes,
the frozen layers' output served from the activation cache (each row carries its index in `idx`).

    .venv/bin/python examples/autofreeze_trainer.py [--steps 300]
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/autofreeze_trainer.py
"""

from __future__ import annotations

import argparse
import os
import tempfile

from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments, set_seed

from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.data import SampleLimits, load_rotten_tomatoes
from pipetransformer.integrations import AutoFreezeCallback
from pipetransformer.models.hf import load_tokenizer, minilm_path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--rows", type=int, default=2000, help="training snippets")
parser.add_argument("--prior", default="none", type=lambda value: int(value) if value.isdigit() else value,
                    help="frozen before any evidence: none (the default), auto, embeddings or a layer count")
args = parser.parse_args()
MAX_LENGTH = 32
data = load_rotten_tomatoes(load_tokenizer(minilm_path()), MAX_LENGTH, limits=SampleLimits(train=args.rows)).train
rows = [{"idx": i, "input_ids": data.input_ids[i], "attention_mask": data.attention_mask[i], "labels": data.labels[i]}
        for i in range(len(data))]

set_seed(0)  # the new classification head is drawn now: the Trainer seeds only once the model exists
model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
training = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=8,
                             learning_rate=5e-5, use_cpu=True, report_to=[], save_strategy="no",
                             ddp_backend="gloo" if "RANK" in os.environ else None,  # torchrun: CPU processes
                             average_tokens_across_devices=False)  # else a classifier's loss doubles under DDP
trainer = Trainer(model=model, args=training, train_dataset=rows)
autofreeze = AutoFreezeCallback.attach(trainer, FreezeConfig(prior=args.prior),  # bound to the trainer: it reaches DDP
                                       cache=CacheConfig(enabled=True), cache_max_length=MAX_LENGTH)
trainer.train()
if trainer.is_world_process_zero():
    cache = autofreeze.freezer.cache
    print(f"{autofreeze.freezer.outcome()}; decisions: {[d['frozen_layers'] for d in autofreeze.decisions]}; "
          f"cache: {cache.hits} served, {cache.computed} computed")
