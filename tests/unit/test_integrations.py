"""The integrations' pure parts: layers found by structure in Hugging Face encoders and decoders, what freezes with
layer 0, and the one-line errors for what cannot work."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.integrations import AutoFreezer, LayerStack, find_layer_stack
from pipetransformer.models.blocks import BlockSplitError

VOCAB = 50
WIDTH = 16


AUTO_PRIOR = FreezeConfig(prior="auto")
"""The prior of a third of a pretrained model's layers (the default until the descent test; the default freezes none)."""

def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=3,
                                                    num_attention_heads=2, intermediate_size=WIDTH))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=3, n_head=2, n_positions=8,
                                      bos_token_id=0, eos_token_id=0))


def test_layers_and_embeddings_are_found_in_an_encoder_with_a_head() -> None:
    model = _bert()
    stack = find_layer_stack(model)
    assert stack.layers == tuple(model.bert.encoder.layer)
    assert stack.embeddings == (model.bert.embeddings,)
    parameters, modules = stack.prefix(2)
    expected = [*model.bert.embeddings.parameters(), *model.bert.encoder.layer[0].parameters(),
                *model.bert.encoder.layer[1].parameters()]
    assert {id(p) for p in parameters} == {id(p) for p in expected}
    assert modules == [model.bert.embeddings, *model.bert.encoder.layer[:2]]
    assert stack.prefix(0) == ([], [])


def test_a_decoder_keeps_its_tied_token_table_training() -> None:
    model = _gpt2()
    stack = find_layer_stack(model)
    assert stack.layers == tuple(model.transformer.h)
    assert stack.embeddings == (model.transformer.wte, model.transformer.wpe)
    parameters, modules = stack.prefix(1)
    ids = {id(p) for p in parameters}
    assert id(model.transformer.wte.weight) not in ids  # the LM head's weight too
    assert id(model.transformer.wpe.weight) in ids
    assert model.transformer.wte not in modules and model.transformer.wpe in modules


def test_models_without_findable_layers_or_with_shared_layers_are_refused_in_one_line() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    named_call = r"AutoFreezer\(LayerStack\(layers, embeddings, model\), optimizer\)"
    with pytest.raises(BlockSplitError, match=f"cannot find the layers of Sequential: .*instead: {named_call}"):
        AutoFreezer(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=100)
    stack = LayerStack(layers=tuple(model), embeddings=(), model=model)  # the call the error names works
    assert AutoFreezer(stack, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=100).frozen_layers == 0
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="layers 0 and 1 share a parameter"):
        LayerStack((shared, shared))
    with pytest.raises(ValueError, match="at least one layer"):
        LayerStack(())


def test_settings_that_cannot_work_are_refused_before_training() -> None:
    model = _bert()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="needs total_steps"):
        AutoFreezer(model, optimizer)  # the default windows are a share of the run
    with pytest.raises(ValueError, match="counts optimizer steps, not epochs"):
        AutoFreezer(model, optimizer, settings=FreezeConfig(interval=1, interval_unit="epochs"))
    freezer = AutoFreezer(model, optimizer, total_steps=200)  # the defaults: 5% windows of 200 steps, floor 10
    assert freezer.policy.name == FreezeConfig.policy and freezer.policy.interval == FreezeConfig.min_window_steps
    with pytest.raises(ValueError, match="use the cache with the model uncompiled, or compile it without cache="):
        AutoFreezer(torch.compile(model), optimizer, total_steps=200, cache=CacheConfig(enabled=True), cache_samples=8)


def test_a_frozen_prefix_runs_without_autograd_and_restores_grad_mode() -> None:
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    freezer = AutoFreezer(model, optimizer, settings=FreezeConfig(policy="schedule", schedule=[[1, 1]]))
    outputs: list[bool] = []
    model.transformer.h[0].register_forward_hook(lambda module, args, output: outputs.append(output[0].requires_grad))
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    assert freezer.step() is not None and freezer.frozen_layers == 1
    loss = model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss
    assert outputs == [True, False] and loss.requires_grad and torch.is_grad_enabled()
    at_start = _gpt2()  # a schedule's entry at 0 holds before the first step, as the prior does
    AutoFreezer(at_start, torch.optim.AdamW(at_start.parameters()), settings=FreezeConfig(policy="schedule",
                                                                                         schedule=[[0, 1]]))
    assert not any(p.requires_grad for p in at_start.transformer.h[0].parameters())


def test_the_prior_freezes_a_pretrained_models_embeddings_and_a_third_of_its_layers_before_the_first_step(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _bert()
    optimizer = torch.optim.AdamW(model.parameters())
    with caplog.at_level(logging.INFO, logger="pipetransformer.integrations.freezer"):
        freezer = AutoFreezer(model, optimizer, total_steps=100, pretrained=True, settings=AUTO_PRIOR)
    # the start-up line says what froze and how each path turns the cache on (the Trainer's callback builds this too)
    assert "the embeddings and the bottom 1 layer frozen" in caplog.text
    assert "cache= with serving(indices), or AutoFreezeCallback.attach(trainer, cache=)" in caplog.text
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    assert freezer.prior.embeddings and freezer.prior.layers == freezer.frozen_layers == 1  # a third of 3 layers
    frozen = [*model.bert.embeddings.parameters(), *model.bert.encoder.layer[0].parameters()]
    assert not any(p.requires_grad or p in in_optimizer for p in frozen)
    assert all(p.requires_grad and p in in_optimizer
               for layer in model.bert.encoder.layer[1:] for p in layer.parameters())
    assert not model.bert.embeddings.training and not model.bert.encoder.layer[0].training
    assert model.bert.encoder.layer[1].training
    assert freezer.at_start == {"step": 0, "frozen_layers": 1, "at_start": freezer.prior.describe()}
    untouched = AutoFreezer(_bert(), torch.optim.AdamW(_bert().parameters()), total_steps=100,
                            settings=AUTO_PRIOR)  # from_config: random weights
    assert not untouched.prior.embeddings and untouched.at_start is None
    default = AutoFreezer(_bert(), torch.optim.AdamW(_bert().parameters()), total_steps=100, pretrained=True)
    assert not default.prior.embeddings and default.at_start is None, "the default prior freezes nothing"


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointed_layers_above_a_frozen_prefix_get_the_plain_runs_gradients(use_reentrant: bool) -> None:
    # the frozen prefix runs without autograd, so its output does not require grad: a reentrant checkpoint of the first
    # active layer would then record no graph, and that layer and every one above it would get no gradient
    torch.manual_seed(0)
    plain = _bert()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    gradients = []
    for model in (plain, checkpointed):
        freezer = AutoFreezer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              settings=FreezeConfig(policy="schedule", schedule=[[0, 1]]))
        assert freezer.frozen_layers == 1
        marked: list[bool] = []  # the prefix's output needs grad only for a reentrant checkpoint (it costs a gradient)
        model.bert.encoder.layer[1].register_forward_pre_hook(lambda module, args: marked.append(args[0].requires_grad))
        model.train()
        torch.manual_seed(1)  # the same dropout masks (the checkpoint replays its forward's random state)
        model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), labels=torch.tensor([0, 1])).loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
        assert marked == [model is checkpointed and use_reentrant]
    assert gradients[0].keys() == gradients[1].keys() and "bert.encoder.layer.1.output.dense.weight" in gradients[0]
    for name, gradient in gradients[0].items():
        assert gradients[1][name] is not None, name
        torch.testing.assert_close(gradients[1][name], gradient, msg=name)


@pytest.mark.parametrize("build, adapted", [(_bert, {"target_modules": ["query", "value"]}),
                                            (_gpt2, {"target_modules": ["c_attn"], "fan_in_fan_out": True})])
def test_a_peft_lora_model_freezes_its_adapters_layer_by_layer(build: object, adapted: dict[str, object]) -> None:
    # LoRA trains only small adapters inside frozen weights: a frozen layer's adapters leave the optimizer and its
    # forward runs without autograd, so the backward stops above it; the other adapters get a plain run's gradients
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    wrapped = get_peft_model(build(), LoraConfig(r=2, lora_dropout=0.0, init_lora_weights=False,  # B non-zero:
                                                 **adapted))                # every adapter gets a gradient
    wrapped.config.name_or_path = "pretrained/lora-base"  # as from_pretrained records it, read through the wrapper
    by_hand = copy.deepcopy(wrapped)
    inner = wrapped.get_base_model()
    stack = find_layer_stack(wrapped)
    assert stack.layers == tuple(find_layer_stack(inner).layers) and len(stack) == 3
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad])
    freezer = AutoFreezer(wrapped, optimizer, total_steps=100, settings=AUTO_PRIOR)
    assert freezer.prior.layers == freezer.frozen_layers == 1  # pretrained, through the wrapper: a third of 3 layers
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    adapters = [n for n, p in wrapped.named_parameters() if "lora_" in n]
    frozen = [n for n in adapters if ".0." in n.split("lora_")[0]]
    params = dict(wrapped.named_parameters())
    assert frozen and not any(params[n].requires_grad or params[n] in in_optimizer for n in frozen)
    assert all(params[n] in in_optimizer for n in adapters if n not in frozen)
    for name, parameter in by_hand.named_parameters():  # PEFT froze the rest: layer 0's adapters are all to freeze
        parameter.requires_grad_(parameter.requires_grad and name not in frozen)
    gradients = []
    for model in (wrapped, by_hand):
        model.eval()  # no dropout: the same forward
        inputs = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
        labels = torch.tensor([0, 1]) if build is _bert else inputs
        model(input_ids=inputs, labels=labels).loss.backward()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert gradients[0].keys() == gradients[1].keys()
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradient, gradients[1][name], msg=name)


def test_a_layer_without_trainable_parameters_is_named_before_training(caplog: pytest.LogCaptureFixture) -> None:
    # adapters on layer 2 only: the gradient tests see nothing in layers 0-1, so the evidence could never freeze
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(_bert(), LoraConfig(r=2, target_modules=["query"], layers_to_transform=[2]))
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    with caplog.at_level(logging.WARNING, logger="pipetransformer.integrations.freezer"):
        AutoFreezer(wrapped, torch.optim.AdamW(trainable), total_steps=100, pretrained=False)
    assert "layer 0 has no trainable parameters, so the descent test cannot find it converged" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipetransformer.integrations.freezer"):  # the fix it names
        freezer = AutoFreezer(wrapped, torch.optim.AdamW(trainable), total_steps=100,
                              settings=FreezeConfig(prior=2))
    assert freezer.frozen_layers == 2 and "no trainable parameters" not in caplog.text


def _plain_loop(steps: int) -> tuple[AutoFreezer, list[int], list[dict[str, object]], dict[str, torch.Tensor]]:
    """A plain loop with the default (descent) freezer in windows of 4 steps: the freezer, the steps (its count when
    called) at which the policy observed statistics, the decisions, and the final weights."""
    torch.manual_seed(0)
    model = _bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    freezer = AutoFreezer(model, optimizer, settings=FreezeConfig(interval=4, interval_unit="steps",
                                                                  min_window_steps=4, learned_min_steps=4))
    observed_at: list[int] = []
    observe = freezer.policy.observe

    def observing(*args: object, **kwargs: object) -> None:
        observed_at.append(freezer.steps)
        observe(*args, **kwargs)

    freezer.policy.observe = observing  # type: ignore[method-assign]
    decisions = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (8, 6), generator=generator)
        model(ids, labels=(ids[:, 0] % 2)).loss.backward()
        if (record := freezer.step()) is not None:
            decisions.append(record)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return freezer, observed_at, decisions, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_plain_loops_freezer_reads_the_device_only_at_a_windows_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of the statistics waits for a GPU's queued work, so the freezer holds each step's on the device and the
    policy observes them all, in order, when a window ends: the same policy state, decisions and weights as reading
    every step."""
    steps = 14
    freezer, observed_at, decisions, weights = _plain_loop(steps)
    assert observed_at == [3] * 4 + [7] * 4 + [11] * 4, observed_at  # 12 steps observed, at the windows' last
    state = freezer.state_dict()  # a checkpoint observes what is still pending: steps 12 and 13
    assert observed_at[12:] == [steps, steps]
    monkeypatch.setattr("pipetransformer.integrations.freezer.MAX_UNREAD_STEPS", 1)  # every step read
    every, observed_every, decisions_every, weights_every = _plain_loop(steps)
    assert observed_every == list(range(steps))
    assert every.state_dict() == state and decisions_every == decisions and every.outcome() == freezer.outcome()
    for name, value in weights.items():
        assert torch.equal(weights_every[name], value), name
