"""Tiny random-initialised Hugging Face models and Rotten Tomatoes batches for the integrations' tests: a
classification encoder and a causal LM small enough that a step takes milliseconds, on the text the project ships."""

from __future__ import annotations

import torch
from torch import nn

from pipetransformer.data import SampleLimits, TextDataset, load_rotten_tomatoes
from pipetransformer.models.hf import load_tokenizer, minilm_path

LAYERS = 6
HIDDEN = 32
HEADS = 2
FFN = 64
MAX_LENGTH = 24
TRAIN_ROWS = 256
IGNORED_LABEL = -100  # Hugging Face losses skip this label (padding)


def rotten_tomatoes(rows: int = TRAIN_ROWS, split_seed: int = 0) -> TextDataset:
    """The first ``rows`` training snippets, tokenized with MiniLM's tokenizer."""
    return load_rotten_tomatoes(load_tokenizer(minilm_path()), MAX_LENGTH, seed=split_seed,
                                limits=SampleLimits(train=rows)).train


def tiny_classifier(vocab_size: int, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=MAX_LENGTH,
                        num_labels=2)
    return BertForSequenceClassification(config)


def tiny_gpt2(vocab_size: int, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                      n_positions=MAX_LENGTH, bos_token_id=0, eos_token_id=0))


def tiny_llama(vocab_size: int, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                        max_position_embeddings=MAX_LENGTH, bos_token_id=0, eos_token_id=0))


def classification_batch(data: TextDataset, step: int, rows: int, rank: int = 0, world: int = 1,
                         seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's share of step ``step``'s batch: a function of the step only, so a resumed run sees the same."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed * 100_003 + step))
    batch = data.get_batch(order[:rows * world][rank::world])
    input_ids, attention_mask = batch.inputs
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": batch.labels}


def lm_batch(data: TextDataset, step: int, rows: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Next-token prediction on the snippets: labels are the inputs, padding ignored."""
    batch = classification_batch(data, step, rows, rank, world)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORED_LABEL)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}
