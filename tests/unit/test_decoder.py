"""The built-in causal decoder: a GPT-2 (Hugging Face's own forward is the reference), causal, blind to padding,
and cut anywhere into blocks whose carried attention mask gives the whole model's logits."""

from __future__ import annotations

import pytest
import torch

from pipetransformer.models.blocks import BlockSequence
from pipetransformer.models.decoder import build_decoder, causal_mask

VOCAB, DIM, DEPTH, HEADS, POSITIONS = 50, 32, 3, 4, 16
WIDE_INIT_STD = 0.3


def decoder(seed: int = 0) -> BlockSequence:
    torch.manual_seed(seed)
    return build_decoder(vocab_size=VOCAB, dim=DIM, depth=DEPTH, heads=HEADS, max_positions=POSITIONS).eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_it_is_gpt2_when_given_gpt2s_weights() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=DIM, n_layer=DEPTH, n_head=HEADS,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager")
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # weights far from init's 0.02, so every nonlinearity works in its curved range
        for parameter in reference.parameters():
            parameter.normal_(std=WIDE_INIT_STD)
    model = decoder()
    source = reference.transformer
    with torch.no_grad():
        model.blocks[0].tokens.weight.copy_(source.wte.weight)
        model.blocks[0].positions.weight.copy_(source.wpe.weight)
        for layer, block in zip(model.blocks[1:-1], source.h, strict=True):
            for ours, theirs in ((layer.qkv, block.attn.c_attn), (layer.attention_out, block.attn.c_proj),
                                 (layer.mlp[0], block.mlp.c_fc), (layer.mlp[2], block.mlp.c_proj)):
                ours.weight.copy_(theirs.weight.T)  # GPT-2's Conv1D keeps [in, out]
                ours.bias.copy_(theirs.bias)
            layer.attention_norm.load_state_dict(block.ln_1.state_dict())
            layer.mlp_norm.load_state_dict(block.ln_2.state_dict())
        model.blocks[-1].final_norm.load_state_dict(source.ln_f.state_dict())
        model.blocks[-1].projection.weight.copy_(reference.lm_head.weight)  # GPT-2 ties it to the token table
    ids = tokens(3, 12)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        actual = model(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], atol=1e-4, rtol=1e-4)


def test_a_position_sees_no_later_token() -> None:
    model = decoder()
    ids = tokens(2, 10)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before, after = model(ids, mask), model(changed, mask)
    torch.testing.assert_close(before[:, :6], after[:, :6], atol=0, rtol=0)
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_padding_changes_no_real_positions_logits() -> None:
    model = decoder()
    ids = tokens(1, 8)
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.int64)], dim=1)
    mask = torch.cat([torch.ones(1, 8, dtype=torch.int64), torch.zeros(1, 5, dtype=torch.int64)], dim=1)
    with torch.no_grad():
        alone = model(ids, torch.ones_like(ids))
        with_padding = model(padded, mask)
    torch.testing.assert_close(with_padding[:, :8], alone, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(with_padding).all()  # padding queries attend to themselves at least


@pytest.mark.parametrize("cut", range(1, DEPTH + 2))
def test_any_stage_boundary_carries_what_the_next_blocks_need(cut: int) -> None:
    model = decoder()
    ids = tokens(2, 9)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    with torch.no_grad():
        whole = model(ids, mask)
        first = model.forward_range((ids, mask), 0, cut)
        rest = model.forward_range(first, cut, len(model))[0]
    torch.testing.assert_close(rest, whole, atol=0, rtol=0)


def test_the_mask_lets_each_query_see_itself_and_the_real_tokens_before_it() -> None:
    mask = torch.tensor([[1, 1, 0]])
    allowed = causal_mask(mask)[0, 0]
    assert allowed.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.parametrize(("settings", "message"), [
    ({"dim": 30, "heads": 4}, "dim 30 is not divisible by heads 4"),
    ({"depth": 0}, "depth must be a positive integer"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
])
def test_bad_settings_name_what_would_work(settings: dict[str, object], message: str) -> None:
    arguments = {"vocab_size": VOCAB, "dim": DIM, "depth": DEPTH, "heads": HEADS, "max_positions": POSITIONS,
                 **settings}
    with pytest.raises(ValueError, match=message):
        build_decoder(**arguments)  # type: ignore[arg-type]


def test_a_batch_longer_than_its_positions_is_refused_with_the_setting_to_change() -> None:
    model = decoder()
    ids = tokens(1, POSITIONS + 1)
    with pytest.raises(ValueError, match="lower data.max_length or raise max_positions"):
        model(ids, torch.ones_like(ids))


def test_every_decoder_setting_is_a_build_decoder_argument_and_documented() -> None:
    import inspect
    from pathlib import Path

    from pipetransformer.models.decoder import DECODER_SETTINGS

    assert set(DECODER_SETTINGS) == set(inspect.signature(build_decoder).parameters) - {"vocab_size"}
    reference = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert all(f"| `model.decoder.{key}` |" in reference for key in DECODER_SETTINGS)
