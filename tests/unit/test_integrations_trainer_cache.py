"""The Hugging Face Trainer's callback serving the frozen layers from the activation cache, in one process (a small
random-initialised BERT, also wrapped by PEFT's LoRA): a cached run trains exactly as a plain one, evaluation rows
keep their index column harmlessly, and training sets without usable indices are refused before training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipetransformer.config import CacheConfig, FreezeConfig

VOCAB = 50
WIDTH = 16
LAYERS = 4
FROZEN = 2
SAMPLES = 32
LENGTH = 10
BATCH = 8
EPOCHS = 3
CACHE = CacheConfig(enabled=True, memory_gb=0.01)
SETTINGS = FreezeConfig(policy="none", prior=FROZEN)  # the prior's layers only, so both runs freeze alike


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                                    num_attention_heads=2, intermediate_size=WIDTH,
                                                    max_position_embeddings=LENGTH))


def _rows(samples: int = SAMPLES) -> list[dict[str, Any]]:
    """Rows of fixed length (so a served batch equals a computed one bit for bit), each with its index."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (samples, LENGTH), generator=generator)
    labels = torch.randint(0, 2, (samples,), generator=generator)
    return [{"idx": i, "input_ids": tokens[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long),
             "labels": labels[i]} for i in range(samples)]


def _ragged_rows() -> list[dict[str, Any]]:
    """Rows of 3 to ``LENGTH`` tokens, unpadded, for a collator that pads each batch to its longest."""
    lengths = torch.randint(3, LENGTH + 1, (SAMPLES,), generator=torch.Generator().manual_seed(2))
    return [{**row, "input_ids": row["input_ids"][:n].tolist(), "attention_mask": [1] * int(n),
             "labels": int(row["labels"])}
            for row, n in zip(_rows(), lengths)]


def _trainer(tmp_path: Path, rows: list[dict[str, Any]], collator: Any = None, model: nn.Module | None = None,
             **arguments: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0, dataloader_num_workers=0, **arguments)
    return Trainer(model=model or _bert(), args=args, train_dataset=rows, eval_dataset=rows, data_collator=collator)


def _losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_a_cached_trainer_run_serves_the_frozen_layers_and_trains_exactly_as_a_plain_one(tmp_path: Path) -> None:
    from pipetransformer.integrations import AutoFreezeCallback

    plain = _trainer(tmp_path / "plain", _rows())  # the index column is dropped as the model does not take it
    AutoFreezeCallback.attach(plain, SETTINGS)
    plain.train()
    cached = _trainer(tmp_path / "cached", _rows())
    callback = AutoFreezeCallback.attach(cached, SETTINGS, cache=CACHE, cache_max_length=LENGTH)
    cached.train()
    assert callback.freezer is not None and callback.freezer.cache is not None
    served = callback.freezer.cache
    # epoch 1 records every sample at the prior's depth; epochs 2 and 3 are served it
    assert (served.computed, served.advanced, served.hits) == (SAMPLES, 0, SAMPLES * (EPOCHS - 1))
    assert served.store is None  # released at the end of training
    assert len(_losses(plain)) == SAMPLES // BATCH * EPOCHS
    assert _losses(cached) == _losses(plain)
    assert cached.evaluate()["eval_loss"] == plain.evaluate()["eval_loss"]  # evaluation drops the index column


def test_batches_padded_to_their_longest_keep_the_index_and_are_served_close_to_computed(tmp_path: Path) -> None:
    from transformers import DataCollatorWithPadding

    from pipetransformer.integrations import AutoFreezeCallback
    from pipetransformer.models.hf import load_tokenizer, minilm_path

    collator = DataCollatorWithPadding(load_tokenizer(minilm_path()))  # pads on the right, passes "idx" on
    plain = _trainer(tmp_path / "plain", _ragged_rows(), collator)
    AutoFreezeCallback.attach(plain, SETTINGS)
    plain.train()
    cached = _trainer(tmp_path / "cached", _ragged_rows(), collator)
    callback = AutoFreezeCallback.attach(cached, SETTINGS, cache=CACHE, cache_max_length=LENGTH)
    cached.train()
    assert callback.freezer is not None and callback.freezer.cache is not None
    assert callback.freezer.cache.hits == SAMPLES * (EPOCHS - 1)
    # a record made in a batch of another length differs only at the padding positions, which attention masks out
    assert _losses(cached) == pytest.approx(_losses(plain), rel=1e-4)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_with_the_cache_trains_as_a_plain_run(tmp_path: Path, use_reentrant: bool) -> None:
    # the Trainer turns checkpointing on in train(), after attach; a reentrant checkpoint above the served prefix
    # (whose output needs no grad) would otherwise leave every training layer without a gradient
    from pipetransformer.integrations import AutoFreezeCallback

    plain = _trainer(tmp_path / "plain", _rows())
    AutoFreezeCallback.attach(plain, SETTINGS)
    plain.train()
    checkpointed = _trainer(tmp_path / "checkpointed", _rows(), gradient_checkpointing=True,
                            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    callback = AutoFreezeCallback.attach(checkpointed, SETTINGS, cache=CACHE, cache_max_length=LENGTH)
    checkpointed.train()
    assert callback.freezer is not None and callback.freezer.cache is not None
    assert callback.freezer.cache.hits == SAMPLES * (EPOCHS - 1)
    assert _losses(checkpointed) == pytest.approx(_losses(plain), rel=1e-5)


def test_training_sets_without_distinct_indices_in_range_are_refused_before_training(tmp_path: Path) -> None:
    from pipetransformer.integrations import AutoFreezeCallback

    without = [{k: v for k, v in row.items() if k != "idx"} for row in _rows()]
    duplicated = [{**row, "idx": row["idx"] // 2} for row in _rows()]
    beyond = [{**row, "idx": row["idx"] + 1} for row in _rows()]
    for rows, message in ((without, "have no 'idx' key"), (duplicated, "must be distinct integers from 0 to 31"),
                          (beyond, "must be distinct integers from 0 to 31")):
        with pytest.raises(ValueError, match=message):
            AutoFreezeCallback.attach(_trainer(tmp_path, rows), SETTINGS, cache=CACHE, cache_max_length=LENGTH)
    renamed = [{("sample" if k == "idx" else k): v for k, v in row.items()} for row in _rows()]
    AutoFreezeCallback.attach(_trainer(tmp_path, renamed), SETTINGS, cache=CACHE, index_column="sample")


def test_a_compiled_trainer_freezes_as_an_eager_one_and_the_cache_refuses_compile(tmp_path: Path) -> None:
    from pipetransformer.integrations import AutoFreezeCallback

    eager = _trainer(tmp_path / "eager", _rows())
    AutoFreezeCallback.attach(eager, SETTINGS)
    eager.train()
    compiled = _trainer(tmp_path / "compiled", _rows(), torch_compile=True)
    AutoFreezeCallback.attach(compiled, SETTINGS)
    before = {name: p.detach().clone() for name, p in compiled.model.named_parameters()}
    compiled.train()
    moved = {name for name, p in compiled.model.named_parameters() if not torch.equal(p.detach(), before[name])}
    frozen = ("bert.embeddings.", *(f"bert.encoder.layer.{i}." for i in range(FROZEN)))
    assert moved and not {name for name in moved if name.startswith(frozen)}
    assert all(any(name.startswith(f"bert.encoder.layer.{i}.") for name in moved) for i in range(FROZEN, LAYERS))
    # inductor's fused kernels round differently: the losses agree to compile's own noise, not bit for bit
    assert _losses(compiled) == pytest.approx(_losses(eager), rel=2e-2)
    with pytest.raises(ValueError, match="set torch_compile=False, or attach without cache="):
        AutoFreezeCallback.attach(_trainer(tmp_path, _rows(), torch_compile=True), SETTINGS, cache=CACHE,
                                  cache_max_length=LENGTH)


def test_a_peft_lora_model_in_the_trainer_is_frozen_and_served_as_a_plain_one(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from pipetransformer.integrations import AutoFreezeCallback

    runs = []
    for name, cache in (("plain", None), ("cached", CACHE)):
        lora = get_peft_model(_bert(), LoraConfig(r=2, target_modules=["query", "value"],
                                                  modules_to_save=["classifier"]))
        trainer = _trainer(tmp_path / name, _rows(), model=lora)
        callback = AutoFreezeCallback.attach(trainer, SETTINGS, cache=cache, cache_max_length=LENGTH)
        trainer.train()
        runs.append((trainer, callback))
    (plain, _), (cached, callback) = runs
    served = callback.freezer.cache
    assert (served.computed, served.hits) == (SAMPLES, SAMPLES * (EPOCHS - 1))
    # the prior's layers' adapters froze; the others, and the head PEFT keeps training, still train
    frozen_prefixes = tuple(f"encoder.layer.{i}." for i in range(FROZEN))
    for name, parameter in cached.model.named_parameters():
        if "lora_" in name:
            assert parameter.requires_grad == (not any(prefix in name for prefix in frozen_prefixes)), name
    assert any(p.requires_grad for n, p in cached.model.named_parameters() if "classifier" in n)
    assert _losses(cached) == _losses(plain)
