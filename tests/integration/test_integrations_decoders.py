"""Causal language models in the plain AutoFreezer: a tiny random-initialised GPT-2 (token table tied to the LM head)
and Llama-style model trained on Rotten Tomatoes snippets; their leading layers freeze and the loss still falls.

The geometric policy freezes at a known step here: the default coherence policy rightly freezes nothing in a few dozen
steps of a random-initialised LM, whose every layer is still learning (coherence 0.22-0.44 after 60 steps)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from hf_text import LAYERS, lm_batch, rotten_tomatoes, tiny_gpt2, tiny_llama
from pipetransformer.config import FreezeConfig
from pipetransformer.integrations import AutoFreezer, find_layer_stack

pytestmark = pytest.mark.slow

STEPS = 24
ROWS = 16
LR = 3e-3
FREEZE_AFTER = 8
SETTINGS = FreezeConfig(policy="geometric", interval=FREEZE_AFTER, interval_unit="steps", max_fraction=1 / 3)
EXPECTED_FROZEN = 2  # max_fraction 1/3 of 6 layers
AVERAGED = 4  # losses averaged at each end of the run


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_a_causal_lm_freezes_its_leading_layers_and_keeps_learning(make: Callable[[int], nn.Module]) -> None:
    torch.manual_seed(0)
    data = rotten_tomatoes()
    model = make(int(data.input_ids.max()) + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    freezer = AutoFreezer(model, optimizer, settings=SETTINGS)
    stack = find_layer_stack(model)
    token_table = model.get_input_embeddings().weight
    tied = token_table is model.get_output_embeddings().weight
    losses, records = [], []
    survivors_state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for step in range(STEPS):
        loss = model(**lm_batch(data, step, ROWS)).loss
        loss.backward()
        if step == FREEZE_AFTER - 1:
            survivors_state = dict(optimizer.state)
        record = freezer.step()
        if record is not None:
            records.append(record)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert [(r["step"], r["frozen_layers"]) for r in records] == [(FREEZE_AFTER - 1, EXPECTED_FROZEN)]
    frozen, training = stack.layers[:EXPECTED_FROZEN], stack.layers[EXPECTED_FROZEN:]
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    assert not any(p.requires_grad or p in in_optimizer for layer in frozen for p in layer.parameters())
    assert all(p.requires_grad and p in in_optimizer for layer in training for p in layer.parameters())
    assert [layer.training for layer in stack.layers] == [False] * EXPECTED_FROZEN + [True] * (LAYERS - EXPECTED_FROZEN)
    # a token table tied to the LM head keeps training (the head uses it); an untied one freezes with layer 0
    assert token_table.requires_grad == tied and (token_table in in_optimizer) == tied
    for parameter, state in survivors_state.items():  # the survivors kept their state objects: Adam went on
        if parameter in in_optimizer:
            assert optimizer.state[parameter] is state
    assert sum(losses[-AVERAGED:]) < sum(losses[FREEZE_AFTER - AVERAGED:FREEZE_AFTER]) < sum(losses[:AVERAGED])
