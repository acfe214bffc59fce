"""The plain API's activation cache on real Hugging Face models (random-initialised, small): a batch served from the
store gives the forward of a plain run, records advance when more layers freeze, and what cannot be cached says
so and runs as it is."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.integrations import AutoFreezer

VOCAB = 50
WIDTH = 16
LAYERS = 4
SAMPLES = 12
MAX_LENGTH = 10
CACHE = CacheConfig(enabled=True, memory_gb=0.01)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                                    num_attention_heads=2, intermediate_size=WIDTH,
                                                    max_position_embeddings=MAX_LENGTH * 2))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                        num_attention_heads=2, num_key_value_heads=2, intermediate_size=WIDTH,
                                        max_position_embeddings=MAX_LENGTH * 2))


def _gpt2(embedding_dropout: float) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=2,
                                      n_positions=MAX_LENGTH * 2, embd_pdrop=embedding_dropout))


def _freezer(model: nn.Module, frozen_layers: int) -> AutoFreezer:
    """The embeddings and the bottom ``frozen_layers`` layers frozen from the start (the prior), cache on."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = FreezeConfig(policy="none", prior=frozen_layers)
    return AutoFreezer(model, optimizer, settings=settings, cache=CACHE, cache_samples=SAMPLES,
                       cache_max_length=MAX_LENGTH)


def _batch(indices: list[int], length: int) -> dict[str, torch.Tensor]:
    """Token ids fixed per sample (its index is its seed), each sample of its own real length, padded on the right
    to ``length``."""
    ids = torch.zeros((len(indices), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, index in enumerate(indices):
        real = 3 + index % 4
        ids[row, :real] = torch.randint(1, VOCAB, (real,), generator=torch.Generator().manual_seed(index))
        mask[row, :real] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model: nn.Module, batch: dict[str, torch.Tensor], freezer: AutoFreezer | None = None,
            indices: list[int] | None = None) -> torch.Tensor:
    torch.manual_seed(1)  # the same dropout masks above the frozen layers in every compared forward
    if freezer is None:
        return model(**batch).logits
    with freezer.serving(indices):
        return model(**batch).logits


@pytest.mark.parametrize("build", [_bert, _llama], ids=["bert", "llama"])
def test_a_batch_served_from_the_cache_gives_the_plain_forward(build) -> None:
    model = build()
    freezer = _freezer(model, frozen_layers=2)
    model.train()
    indices = [3, 0, 7, 5]
    batch = _batch(indices, MAX_LENGTH)
    plain = _logits(model, batch)
    first = _logits(model, batch, freezer, indices)  # computes and records
    assert (freezer.cache.computed, freezer.cache.hits) == (4, 0)
    served = _logits(model, batch, freezer, indices)  # the frozen layers skipped
    assert (freezer.cache.computed, freezer.cache.hits) == (4, 4)
    assert torch.equal(first, plain) and torch.equal(served, plain)
    served.sum().backward()
    assert all(p.grad is None for p in freezer.stack.layers[0].parameters())
    assert all(p.grad is not None for p in freezer.stack.layers[-1].parameters())


@pytest.mark.cuda
def test_records_kept_on_the_host_are_served_to_a_model_on_cuda() -> None:
    device = torch.device("cuda")
    model = _bert().to(device)
    freezer = _freezer(model, frozen_layers=2)
    model.eval()
    indices = [2, 5]
    batch = {k: v.to(device) for k, v in _batch(indices, MAX_LENGTH).items()}
    _logits(model, batch, freezer, indices)
    served = _logits(model, batch, freezer, indices)
    assert freezer.cache.hits == len(indices) and served.device.type == "cuda"
    torch.testing.assert_close(served, _logits(model, batch))


def test_records_are_cut_to_a_shorter_batch_and_padded_for_a_longer_one() -> None:
    model = _bert()
    freezer = _freezer(model, frozen_layers=2)
    model.eval()
    indices = [1, 2, 6]
    _logits(model, _batch(indices, 7), freezer, indices)  # recorded in a batch padded to 7 positions
    for length in (6, MAX_LENGTH):
        batch = _batch(indices, length)
        served = _logits(model, batch, freezer, indices)
        torch.testing.assert_close(served, _logits(model, batch), rtol=1e-5, atol=1e-6)
    assert freezer.cache.hits == 2 * len(indices)


def test_records_advance_through_only_the_newly_frozen_layer() -> None:
    model = _bert()
    freezer = _freezer(model, frozen_layers=1)
    model.eval()
    indices = [4, 9]
    batch = _batch(indices, MAX_LENGTH)
    _logits(model, batch, freezer, indices)
    freezer._freeze(2)  # what a decision does
    calls: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
             for i, layer in enumerate(freezer.stack.layers)]
    advanced = _logits(model, batch, freezer, indices)
    assert freezer.cache.advanced == len(indices)
    assert calls[1:] == [1, 2, 3], "layer 0 served from its record, layer 1 run to advance it"
    torch.testing.assert_close(advanced, _logits(model, batch), rtol=1e-5, atol=1e-6)
    calls.clear()
    _logits(model, batch, freezer, indices)
    assert freezer.cache.hits == len(indices) and calls[2:] == [2, 3]
    for hook in hooks:
        hook.remove()
    assert "forward" not in vars(freezer.stack.layers[0]), "the layers' own forward is back after serving"


def test_a_batch_with_unrecorded_samples_runs_in_full_and_records_them() -> None:
    model = _bert()
    freezer = _freezer(model, frozen_layers=2)
    model.eval()
    _logits(model, _batch([0, 1], MAX_LENGTH), freezer, [0, 1])
    mixed = [1, 2]
    _logits(model, _batch(mixed, MAX_LENGTH), freezer, mixed)
    assert (freezer.cache.computed, freezer.cache.hits) == (4, 0)
    _logits(model, _batch(mixed, MAX_LENGTH), freezer, mixed)
    assert freezer.cache.hits == 2


def test_a_random_prefix_turns_the_cache_off_once_and_trains_as_before(caplog) -> None:
    model = _gpt2(embedding_dropout=0.1)
    freezer = _freezer(model, frozen_layers=2)
    model.train()
    batch = _batch([0, 1], MAX_LENGTH)
    with caplog.at_level(logging.WARNING, logger="pipetransformer.integrations.cache"):
        for _ in range(2):
            assert torch.equal(_logits(model, batch, freezer, [0, 1]), _logits(model, batch))
    warnings = [r.getMessage() for r in caplog.records if "activation cache off" in r.getMessage()]
    assert len(warnings) == 1 and "GPT2Model.drop" in warnings[0]
    assert freezer.cache.store is None


def test_a_decoder_without_embedding_dropout_is_served() -> None:
    model = _gpt2(embedding_dropout=0.0)
    freezer = _freezer(model, frozen_layers=2)
    model.train()
    indices = [8, 11]
    batch = _batch(indices, MAX_LENGTH)
    plain = _logits(model, batch)
    _logits(model, batch, freezer, indices)
    assert torch.equal(_logits(model, batch, freezer, indices), plain) and freezer.cache.hits == 2


def test_a_batch_drawn_with_replacement_records_each_sample_once() -> None:
    model = _bert()
    freezer = _freezer(model, frozen_layers=2)
    model.eval()
    indices = [5, 2, 5, 2, 7]
    batch = _batch(indices, MAX_LENGTH)
    _logits(model, batch, freezer, indices)
    served = _logits(model, batch, freezer, indices)
    assert freezer.cache.hits == len(indices) and torch.equal(served, _logits(model, batch))


def test_bad_cache_arguments_are_refused_in_one_line() -> None:
    model = _bert()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="needs cache_samples"):
        AutoFreezer(model, optimizer, settings=FreezeConfig(policy="none", prior=1), cache=CACHE)
    freezer = _freezer(model, frozen_layers=1)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 12\)"):
        _logits(model, _batch([0, 1], MAX_LENGTH), freezer, [0, SAMPLES])
    # text without cache_max_length: the first batch's length fixes the records, a longer batch says what to pass
    text = _bert()
    fixed = AutoFreezer(text, torch.optim.AdamW(text.parameters()), settings=FreezeConfig(policy="none", prior=1),
                        cache=CACHE, cache_samples=SAMPLES)
    _logits(text, _batch([0, 1], MAX_LENGTH - 2), fixed, [0, 1])
    with pytest.raises(ValueError, match="pass cache_max_length"):
        _logits(text, _batch([2, 3], MAX_LENGTH), fixed, [2, 3])
