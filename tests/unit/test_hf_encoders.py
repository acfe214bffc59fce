"""Hugging Face encoders split into blocks reproduce the model's own forward and gradients, or are refused.

A pinned list of encoder types transformers ships, each with a random tiny config: block-by-block forward
against the model's own ``last_hidden_state`` on a padded batch (every position, padding included), eager
and sdpa where the model has both. Encoders whose encoder module computes something once for all layers
from trainable parameters (MPNet's position bias, DeBERTa's relative embeddings) also have their gradients
compared, and the three ways such shared state can go wrong are tested apart: micro-batching and the cache
(the state rides the activation, split along the batch), pipeline stages (its gradient flows back from
every stage) and freezing (it freezes with layer 0, whose cached outputs depend on it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipetransformer.cache.prefix import FrozenPrefixCache
from pipetransformer.cache.store import ActivationStore, spec_from_activation
from pipetransformer.freeze import frozen_blocks
from pipetransformer.freeze.apply import freeze_blocks
from pipetransformer.models.blocks import Activation, BlockSequence, BlockSplitError
from pipetransformer.models.hf import blocks_from_hf, load_hf_encoder
from pipetransformer.pipe.stage import StageModule

HIDDEN = 32
SMALL_EMBEDDING = 16
HEADS = 4
LAYERS = 3
INTERMEDIATE = 64
VOCAB = 100
MAX_POSITIONS = 64
NUM_LABELS = 3
LENGTHS = (9, 5, 7, 3)  # real tokens per sample of the padded batch
SEQ = max(LENGTHS)
RELATIVE_TOLERANCE = 1e-5
GRAD_RELATIVE_TOLERANCE = 1e-5
GRAD_NOISE_FLOOR = 1e-6
"""Analytically zero gradients (attention key biases) are float noise: compared at this fraction of the largest."""
STORE_BYTES = 1 << 20
EAGER = ("eager",)
BOTH = ("eager", "sdpa")

BERT_LIKE: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": INTERMEDIATE,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
}
DEBERTA_RELATIVE: dict[str, Any] = {"relative_attention": True, "pos_att_type": ["p2c", "c2p"]}

# name -> (config with model_type, attention implementations the model has)
ENCODERS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "bert": ({"model_type": "bert", **BERT_LIKE}, BOTH),
    "roberta": ({"model_type": "roberta", **BERT_LIKE}, BOTH),
    "distilbert": ({"model_type": "distilbert", "dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS,
                    "hidden_dim": INTERMEDIATE, "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS}, BOTH),
    "electra": ({"model_type": "electra", **BERT_LIKE, "embedding_size": HIDDEN}, BOTH),
    # ELECTRA-small's real shape: embeddings narrower than the layers, projected by the model (not the encoder)
    "electra-projected": ({"model_type": "electra", **BERT_LIKE, "embedding_size": SMALL_EMBEDDING}, BOTH),
    "xlm-roberta": ({"model_type": "xlm-roberta", **BERT_LIKE}, BOTH),
    "camembert": ({"model_type": "camembert", **BERT_LIKE}, BOTH),
    "ernie": ({"model_type": "ernie", **BERT_LIKE}, BOTH),
    "data2vec-text": ({"model_type": "data2vec-text", **BERT_LIKE}, BOTH),
    "roberta-prelayernorm": ({"model_type": "roberta-prelayernorm", **BERT_LIKE}, BOTH),  # final norm at the model
    "xlm-roberta-xl": ({"model_type": "xlm-roberta-xl", **BERT_LIKE}, BOTH),  # final norm in the encoder
    "megatron-bert": ({"model_type": "megatron-bert", **BERT_LIKE}, EAGER),  # final norm in the encoder
    "convbert": ({"model_type": "convbert", **BERT_LIKE, "embedding_size": SMALL_EMBEDDING}, EAGER),
    # narrow embeddings projected by the encoder before layer 0
    "rembert": ({"model_type": "rembert", **BERT_LIKE, "input_embedding_size": SMALL_EMBEDDING,
                 "output_embedding_size": SMALL_EMBEDDING}, EAGER),
    # the encoder computes one position bias for all layers (all-mpnet-base-v2)
    "mpnet": ({"model_type": "mpnet", **BERT_LIKE}, EAGER),
    # relative embeddings in the encoder; 4 < SEQ relative positions, so the clamped ones are covered
    "deberta": ({"model_type": "deberta", **BERT_LIKE, **DEBERTA_RELATIVE, "max_relative_positions": 4}, EAGER),
    # DeBERTa-v3's shape: log-bucketed relative positions (4 buckets < SEQ), normed relative embeddings
    "deberta-v2": ({"model_type": "deberta-v2", **BERT_LIKE, **DEBERTA_RELATIVE, "position_buckets": 4,
                    "max_relative_positions": MAX_POSITIONS, "norm_rel_ebd": "layer_norm", "share_att_key": True,
                    "position_biased_input": False}, EAGER),
    # DeBERTa-v2-xlarge's shape: a convolution after layer 0, separate position projections, narrow embeddings
    "deberta-v2-conv": ({"model_type": "deberta-v2", **BERT_LIKE, **DEBERTA_RELATIVE, "conv_kernel_size": 3,
                         "norm_rel_ebd": "layer_norm", "share_att_key": False, "embedding_size": SMALL_EMBEDDING},
                        EAGER),
    # rotary tables and sliding-window masks computed by the model; layers alternate global and local attention
    "modernbert": ({"model_type": "modernbert", **BERT_LIKE, "global_attn_every_n_layers": 2, "local_attention": 4,
                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2},
                   BOTH),
}
# Encoders whose encoder-level state comes from trainable parameters: gradients are compared too.
SHARED_STATE = ("mpnet", "deberta", "deberta-v2", "deberta-v2-conv")
# The trainable parameters each keeps for all its layers (paths in the Hugging Face model).
SHARED_PARAMETERS = {
    "mpnet": ("encoder.relative_attention_bias.weight",),
    "deberta": ("encoder.rel_embeddings.weight",),
    "deberta-v2": ("encoder.rel_embeddings.weight", "encoder.LayerNorm.weight", "encoder.LayerNorm.bias"),
    "deberta-v2-conv": ("encoder.rel_embeddings.weight", "encoder.LayerNorm.weight", "encoder.LayerNorm.bias"),
}
CASES = [(name, impl) for name, (_, impls) in ENCODERS.items() for impl in impls]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: handing each small op to a second thread costs more than the op (10-50x on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def encoder_for(name: str, attn_implementation: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config, _ = ENCODERS[name]
    return load_hf_encoder(config=config, attn_implementation=attn_implementation).eval()


def padded_batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (never the pad id) of LENGTHS real tokens, padded to the longest as a tokenizer pads them."""
    generator = torch.Generator().manual_seed(0)
    input_ids = (pad_id + 1 + torch.randint(0, VOCAB - 1, (len(LENGTHS), SEQ), generator=generator)) % VOCAB
    attention_mask = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).to(torch.long)
    return input_ids.masked_fill(attention_mask == 0, pad_id), attention_mask


def pad_id_of(encoder: nn.Module) -> int:
    pad = getattr(encoder.config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def final_hidden(blocks: BlockSequence, activation: Activation) -> torch.Tensor:
    """The last layer's output through the head's final norm (the model's own last_hidden_state)."""
    hidden = blocks.forward_range(activation, 0, blocks.num_layers + 1)[0]
    return blocks.blocks[-1].final_norm(hidden)


def assert_relatively_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> None:
    assert actual.shape == expected.shape, what
    scale = max(1.0, expected.abs().max().item())
    diff = (actual - expected).abs().max().item()
    assert diff <= tolerance * scale, f"{what}: max |diff| {diff:.3g} > {tolerance:g} x {scale:.3g}"


def named_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def probe_loss(hidden: torch.Tensor) -> torch.Tensor:
    """A fixed random linear function of every position, so every output entry gets a gradient."""
    generator = torch.Generator().manual_seed(1)
    return (hidden * torch.randn(hidden.shape, generator=generator)).sum()


@pytest.mark.parametrize(("name", "attn_implementation"), CASES)
def test_blocks_reproduce_last_hidden_state(name: str, attn_implementation: str) -> None:
    encoder = encoder_for(name, attn_implementation)
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    input_ids, attention_mask = padded_batch(pad_id_of(encoder))
    with torch.no_grad():
        expected = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        activation: Activation = (input_ids, attention_mask)
        for index in range(blocks.num_layers + 1):  # block by block, as pipeline stages would run them
            activation = blocks.forward_range(activation, index, index + 1)
            assert all(t.is_contiguous() for t in activation), f"block {index}: gloo p2p needs contiguous tensors"
        assert torch.equal(activation[1], attention_mask)
        actual = blocks.blocks[-1].final_norm(activation[0])
        (logits,) = blocks.forward_range(activation, blocks.num_layers + 1, len(blocks))
    assert_relatively_close(actual, expected, RELATIVE_TOLERANCE, f"{name} ({attn_implementation})")
    assert logits.shape == (len(LENGTHS), NUM_LABELS)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_every_parameter_has_one_owner_and_checkpoints_round_trip(name: str) -> None:
    """Per-block machinery (freezing, optimizer, hand-over, gradient sync) sees each parameter exactly once,
    and a checkpoint of ``named_parameters()`` loads back strictly."""
    encoder = encoder_for(name)
    blocks = blocks_from_hf(encoder, NUM_LABELS)
    owners: dict[int, list[int]] = {}
    for index, block in enumerate(blocks.blocks):
        for parameter in block.parameters():
            owners.setdefault(id(parameter), []).append(index)
    for path, parameter in encoder.named_parameters():
        if path.startswith("pooler."):  # the model's pooler is not used by a classification head of ours
            continue
        assert len(owners.get(id(parameter), [])) == 1, f"{name}: {path} is held by blocks {owners.get(id(parameter))}"
    for path in SHARED_PARAMETERS.get(name, ()):
        assert owners[id(encoder.get_parameter(path))] == [0], f"{name}: {path} must belong to the embeddings block"
    weights = {n: p.detach().clone() for n, p in blocks.named_parameters()}
    assert set(blocks.state_dict()) == set(weights)
    blocks.load_state_dict(weights)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_a_frozen_block_stays_in_eval_mode_when_the_model_trains(name: str) -> None:
    """The cache serves frozen blocks only when none of their modules trains: no module may be shared with a block
    that trains (ModernBERT's rotary module once was, and turned the frozen layer's back to training mode)."""
    blocks = blocks_from_hf(encoder_for(name), NUM_LABELS)
    freeze_blocks(blocks, frozen_blocks({0}, blocks.num_layers), None)
    blocks.train()
    assert [n for n, m in blocks.blocks[1].named_modules() if m.training] == []


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_gradients_match_the_unsplit_model(name: str) -> None:
    """Every parameter's gradient, each relative to its own scale: the shared tables' gradients are thousands of
    times smaller than the largest."""
    encoder = encoder_for(name)
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    input_ids, attention_mask = padded_batch(pad_id_of(encoder))
    probe_loss(encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state).backward()
    expected = named_grads(encoder)
    encoder.zero_grad(set_to_none=True)
    probe_loss(final_hidden(blocks, (input_ids, attention_mask))).backward()
    actual = named_grads(encoder)
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    floor = GRAD_NOISE_FLOOR * max(g.abs().max().item() for g in expected.values())
    for path, grad in expected.items():
        scale = max(grad.abs().max().item(), floor)
        diff = (actual[path] - grad).abs().max().item()
        assert diff <= GRAD_RELATIVE_TOLERANCE * scale, f"{name}: {path} gradient off by {diff:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", SHARED_STATE)
def test_shared_state_splits_along_the_batch(name: str) -> None:
    """Micro-batches: the activation after any block, cut into two halves along the batch, gives the halves of
    the whole batch's output, so a pipeline schedule may split it anywhere."""
    encoder = encoder_for(name)
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    input_ids, attention_mask = padded_batch(pad_id_of(encoder))
    half = len(LENGTHS) // 2
    with torch.no_grad():
        for boundary in range(1, blocks.num_layers + 1):
            activation = blocks.forward_range((input_ids, attention_mask), 0, boundary)
            assert all(t.shape[0] == len(LENGTHS) for t in activation), "every tensor must have a batch dimension"
            whole = blocks.forward_range(activation, boundary, blocks.num_layers + 1)[0]
            first = blocks.forward_range(tuple(t[:half] for t in activation), boundary, blocks.num_layers + 1)[0]
            second = blocks.forward_range(tuple(t[half:] for t in activation), boundary, blocks.num_layers + 1)[0]
            assert_relatively_close(torch.cat([first, second]), whole, RELATIVE_TOLERANCE, f"{name} at {boundary}")


@pytest.mark.parametrize("name", SHARED_STATE)
def test_cached_prefix_serves_shared_state_in_any_batch(name: str, tmp_path: Path) -> None:
    """The cache stores each sample's activation padded to a fixed length and serves it cut to the batch's:
    samples first computed in a short batch, then served in a longer one (the first row among them), still
    give the plain forward's output on every real token."""
    encoder = encoder_for(name)
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    freeze_blocks(blocks, frozen_blocks({0}, blocks.num_layers), None)
    boundary = 2  # embeddings + layer 0 frozen and cached
    input_ids, attention_mask = padded_batch(pad_id_of(encoder))
    with torch.no_grad():
        example = blocks.forward_range((input_ids, attention_mask), 0, boundary)
    spec = spec_from_activation(example, pad_to=SEQ)
    short = torch.tensor([1, 3])  # lengths 5 and 3: recorded 5 positions long
    served_order = torch.tensor([3, 0, 1, 2])  # a short record first, the longest sample second
    batch = (input_ids[served_order], attention_mask[served_order])
    with ActivationStore.create(len(LENGTHS), spec, STORE_BYTES, tmp_path) as store:
        cache = FrozenPrefixCache(store)
        recorded = int(attention_mask[short].sum(1).max())
        cache.activation_at_boundary(blocks, (input_ids[short, :recorded], attention_mask[short, :recorded]), short,
                                     boundary)
        served = cache.activation_at_boundary(blocks, batch, served_order, boundary)
        assert cache.metrics().hits == len(short)
    with torch.no_grad():
        actual = blocks.forward_range(served, boundary, blocks.num_layers + 1)[0]
        expected = blocks.forward_range(batch, 0, blocks.num_layers + 1)[0]
    real = batch[1].bool()
    assert_relatively_close(actual[real], expected[real], RELATIVE_TOLERANCE, name)


@pytest.mark.parametrize("name", SHARED_STATE)
def test_shared_gradient_sums_over_pipeline_stages(name: str) -> None:
    """Two stages as a pipeline runs them (the second gets detached inputs and sends their gradients back):
    the shared parameters, held by stage 0, get the gradient of every layer on both stages."""
    encoder = encoder_for(name)
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    input_ids, attention_mask = padded_batch(pad_id_of(encoder))
    probe_loss(encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state).backward()
    expected = {path: encoder.get_parameter(path).grad.clone() for path in SHARED_PARAMETERS[name]}
    encoder.zero_grad(set_to_none=True)
    cut = 2  # stage 0: embeddings + layer 0; stage 1: layers 1.. (all use the shared state)
    first = StageModule(list(blocks.blocks)[:cut], is_last=False)
    second = StageModule(list(blocks.blocks)[cut:blocks.num_layers + 1], is_last=False)
    sent = first(input_ids, attention_mask)
    received = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in sent)
    probe_loss(blocks.blocks[-1].final_norm(second(*received)[0])).backward()
    float_pairs = [(out, inp.grad) for out, inp in zip(sent, received, strict=True) if inp.is_floating_point()]
    assert len(float_pairs) > 1, "the shared state must cross the stage boundary with the hidden states"
    torch.autograd.backward([out for out, _ in float_pairs], [grad for _, grad in float_pairs])
    for path, grad in expected.items():
        assert_relatively_close(encoder.get_parameter(path).grad, grad, GRAD_RELATIVE_TOLERANCE, f"{name}: {path}")


@pytest.mark.parametrize("name", SHARED_STATE)
def test_shared_state_freezes_with_layer_zero(name: str) -> None:
    """Once layer 0 is frozen (and its outputs may be cached), the shared parameters it used stop training:
    off the optimizer, no gradient, unchanged by a step of the still-active blocks."""
    encoder = encoder_for(name)
    blocks = blocks_from_hf(encoder, NUM_LABELS)
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1.0)
    freeze_blocks(blocks, frozen_blocks({0}, blocks.num_layers), optimizer)
    shared = [encoder.get_parameter(path) for path in SHARED_PARAMETERS[name]]
    before = [p.detach().clone() for p in shared]
    input_ids, attention_mask = padded_batch(pad_id_of(encoder))
    with torch.no_grad():
        prefix = blocks.forward_range((input_ids, attention_mask), 0, 2)
    logits = blocks.forward_range(prefix, 2, len(blocks))[0]
    logits.sum().backward()
    optimizer.step()
    kept = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for path, parameter, value in zip(SHARED_PARAMETERS[name], shared, before, strict=True):
        assert not parameter.requires_grad, f"{name}: {path} still trains after layer 0 froze"
        assert id(parameter) not in kept and parameter.grad is None, path
        assert torch.equal(parameter, value), path


class _Shifted(nn.Module):
    """A stand-in for an encoder-level computation the blocks cannot see: the encoder's output moves."""

    def forward(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        output.last_hidden_state = output.last_hidden_state + 1.0
        return output


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "albert", **BERT_LIKE, "embedding_size": SMALL_EMBEDDING}, r"albert.*share"),
        ({"model_type": "gpt2", "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "vocab_size": VOCAB},
         r"gpt2.*(causal|decoder)"),
        ({"model_type": "llama", **BERT_LIKE, "num_key_value_heads": HEADS}, r"llama.*(causal|decoder)"),
        ({"model_type": "bert", **BERT_LIKE, "is_decoder": True}, r"bert.*(causal|decoder)"),
    ],
    ids=["albert", "gpt2", "llama", "bert-decoder"],
)
def test_unsupported_encoders_are_refused_in_one_line(config: dict[str, Any], message: str) -> None:
    torch.manual_seed(0)
    encoder = load_hf_encoder(config=config, attn_implementation="eager")
    with pytest.raises(BlockSplitError, match=message) as caught:
        blocks_from_hf(encoder, NUM_LABELS)
    assert "\n" not in str(caught.value)


def test_an_encoder_the_blocks_do_not_reproduce_is_refused() -> None:
    """Whatever an unknown encoder computes beyond its embeddings and layers, a split that does not reproduce
    its forward is refused, naming the model type, rather than trained silently wrong."""
    encoder = encoder_for("bert")
    encoder.encoder.register_forward_hook(_Shifted())
    with pytest.raises(BlockSplitError, match=r"bert.*reproduce") as caught:
        blocks_from_hf(encoder, NUM_LABELS)
    assert "\n" not in str(caught.value)


def test_layers_sharing_weights_are_refused() -> None:
    """Freezing, optimizer state, hand-over and gradient sync work per block: a parameter two blocks use would be
    frozen by one while the other trains it, and updated twice on one stage."""
    encoder = encoder_for("bert")
    encoder.encoder.layer[2] = encoder.encoder.layer[0]
    with pytest.raises(BlockSplitError, match=r"bert.*layer_0 and layer_2.*shared") as caught:
        blocks_from_hf(encoder, NUM_LABELS)
    assert "\n" not in str(caught.value)


def test_attention_kernel_the_model_lacks_is_a_one_line_error() -> None:
    config, _ = ENCODERS["mpnet"]
    with pytest.raises(ValueError, match=r"mpnet.*sdpa.*model.attn_implementation.*eager") as caught:
        load_hf_encoder(config=config, attn_implementation="sdpa")
    assert "\n" not in str(caught.value)
