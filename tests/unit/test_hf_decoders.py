"""Hugging Face causal language models (GPT-2, Llama) as block sequences: their own logits, the tied weight's
gradient, the refusals, the tokenizer's corpus, and ``predict`` / ``export`` of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_decoders import decoder_config, write_decoder
from pipetransformer.config import ConfigError, config_from_dict
from pipetransformer.data.corpus import BYTES, TokenWindows, load_corpus, tokenizer_vocabulary
from pipetransformer.dp.ties import TiedWeightSync
from pipetransformer.models import BlockSplitError, build_model
from pipetransformer.models.hf_decoder import DecoderLayer, _check_reproduces, blocks_from_hf_decoder

VOCABULARY = 257
ROWS, TOKENS, PADDED_FROM = 3, 12, 7
EXACT = 1e-5
FAMILIES = [("gpt2", True), ("llama", False), ("llama", True)]


def _model(family: str, tied: bool, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = decoder_config(family, tied=tied)
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCABULARY, (ROWS, TOKENS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[-1, PADDED_FROM:] = 0
    return ids, mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("family", "tied"), FAMILIES)
def test_blocks_give_the_models_own_logits_and_declare_a_tied_projection(family: str, tied: bool, attn: str) -> None:
    model = _model(family, tied, attn)
    ids, mask = _batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    blocks = blocks_from_hf_decoder(model).eval()
    with torch.no_grad():
        actual = blocks(ids, mask)
    real = mask.bool()
    assert (actual[real] - expected[real]).abs().max() <= EXACT
    assert len(blocks) == 2 + model.config.num_hidden_layers
    assert [(t.owner, t.mirror) for t in blocks.ties] == (
        [("blocks.0.tokens.weight", f"blocks.{len(blocks) - 1}.projection.weight")] if tied else [])
    owner, mirror = (blocks.get_parameter(n) for n in ("blocks.0.tokens.weight",
                                                      f"blocks.{len(blocks) - 1}.projection.weight"))
    assert owner is not mirror  # two parameters, so the two blocks can sit on different stages
    assert torch.equal(owner, mirror) == tied


class _StretchedRotary(torch.nn.Module):
    """Rotary tables at twice the positions: other distances between tokens."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(hidden, position_ids=2 * position_ids)


def test_a_split_that_gets_the_positions_wrong_is_refused() -> None:
    """The check against the model's own logits can fail: layers whose rotary tables are at other positions."""
    model = _model("llama", tied=False)
    blocks = blocks_from_hf_decoder(model)
    for block in blocks.blocks[1:-1]:
        assert isinstance(block, DecoderLayer)
        block.rotary = _StretchedRotary(block.rotary)
    with pytest.raises(BlockSplitError, match="do not reproduce the model's own logits"):
        _check_reproduces(model, blocks, "LlamaForCausalLM")


def test_the_tied_weights_gradient_is_the_models_once_the_mirrors_is_folded_in() -> None:
    """One process: the owner's gradient plus the mirror's is the tied weight's gradient in the model itself; the
    owner's alone (what a silent copy would train on) is not."""
    reference = _model("gpt2", tied=True)
    model = _model("gpt2", tied=True)
    blocks = blocks_from_hf_decoder(model)
    ids, mask = _batch()
    weights = torch.randn(ROWS, TOKENS, VOCABULARY, generator=torch.Generator().manual_seed(2))
    (reference(input_ids=ids, attention_mask=mask).logits * weights).sum().backward()
    (blocks(ids, mask) * weights).sum().backward()
    expected = reference.transformer.wte.weight.grad
    (owner, mirror), = blocks.tied_parameters()
    assert not torch.allclose(owner.grad, expected, atol=1e-4)
    TiedWeightSync(blocks, rank=0, owner_rank=0, mirror_rank=0).fold_gradients()
    assert mirror.grad is None
    assert torch.allclose(owner.grad, expected, atol=1e-5)


@pytest.mark.parametrize(("family", "tied"), FAMILIES)
def test_a_frozen_layer_stays_in_eval_mode_when_the_model_trains(family: str, tied: bool) -> None:
    """No module is shared between layer blocks (Llama's rotary module is copied per layer), so a frozen layer stays
    in eval mode, as the cache requires."""
    from pipetransformer.freeze.apply import freeze_blocks

    blocks = blocks_from_hf_decoder(_model(family, tied))
    freeze_blocks(blocks, range(2), None)
    blocks.train()
    assert [n for n, m in blocks.blocks[1].named_modules() if m.training] == []


def test_the_mirror_freezes_with_its_owner_and_no_optimizer_holds_it() -> None:
    from pipetransformer.config import TrainConfig
    from pipetransformer.freeze.apply import freeze_blocks
    from pipetransformer.train.optimizer import HeldOptimizer

    blocks = blocks_from_hf_decoder(_model("gpt2", tied=True))
    (owner, mirror), = blocks.tied_parameters()
    optimizer = HeldOptimizer(blocks, TrainConfig())
    optimizer.rebuild((0, len(blocks)), {})
    held = {id(p) for p in optimizer.params}
    assert id(owner) in held and id(mirror) not in held
    assert mirror.requires_grad
    freeze_blocks(blocks, range(2), optimizer.optimizer)
    assert not owner.requires_grad and not mirror.requires_grad


@pytest.mark.parametrize("config", [{"model_type": "mistral"}, {"model_type": "mixtral"},
                                    {"model_type": "gpt2", "add_cross_attention": True}],
                         ids=["sliding_window", "mixture_of_experts", "cross_attention"])
def test_what_the_blocks_cannot_compute_is_refused_from_the_config(config: dict[str, object], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = {"mistral": "sliding-window", "mixtral": "mixture-of-experts", "gpt2": "cross-attention"}
    with pytest.raises(BlockSplitError, match=expected[str(config["model_type"])]):
        build_model("hf_decoder", num_labels=VOCABULARY, path=str(tmp_path))


def test_a_byte_tokenizers_corpus_and_instructions_are_the_bytes_and_a_tokenizer_without_an_end_is_refused() -> None:
    from pipetransformer.export import byte_tokenizer

    tokenizer = byte_tokenizer()
    vocabulary = tokenizer_vocabulary(tokenizer, VOCABULARY, "here")
    ours = load_corpus("rotten_tomatoes", max_length=32, vocabulary=vocabulary)
    theirs = load_corpus("rotten_tomatoes", max_length=32, vocabulary=BYTES)
    for mine, bytes_ in zip(ours, theirs, strict=True):
        assert torch.equal(mine.input_ids, bytes_.input_ids) and torch.equal(mine.labels, bytes_.labels)
    prompts, responses = ["Q: 2 plus 3? A:", "Q: caf\u00e9? A:"], [" 5", " oui"]
    mine, bytes_ = (TokenWindows.examples(prompts, responses, 24, v) for v in (vocabulary, BYTES))
    assert torch.equal(mine.input_ids, bytes_.input_ids) and torch.equal(mine.labels, bytes_.labels)
    assert torch.equal(mine.attention_mask, bytes_.attention_mask)
    assert vocabulary.decode(vocabulary.encode("caf\u00e9 noir") + [256, 65]) == "caf\u00e9 noir"
    with pytest.raises(ValueError, match="has 257 tokens but the model 100 token rows"):
        tokenizer_vocabulary(tokenizer, 100, "here")
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no eos_token"):
        tokenizer_vocabulary(tokenizer, VOCABULARY, "here")


def test_an_hf_decoder_needs_a_path_and_nothing_else() -> None:
    base = {"data": {"name": "rotten_tomatoes"}}
    with pytest.raises(ConfigError, match="model.kind=hf_decoder needs model.path"):
        config_from_dict({**base, "model": {"kind": "hf_decoder"}})
    with pytest.raises(ConfigError, match="model.kind=hf_decoder needs model.path"):
        config_from_dict({**base, "model": {"kind": "hf_decoder", "path": "x", "decoder": {"dim": 8}}})


def test_an_hf_decoders_run_continues_prompts_and_exports_tied_as_its_own_class(tmp_path: Path) -> None:
    """The export is the model's own class with the trained weights, tied again: its logits are the run's, and
    ``generate`` continues a prompt as ``predict`` does."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipetransformer.export import EXACT_ATOL, export_command
    from pipetransformer.predict import continue_prompts, load_run_model
    from pipetransformer.train.build import build_blocks

    path = write_decoder(tmp_path / "gpt2", "gpt2", tied=True)
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    run_dir.mkdir()
    settings = {"model": {"kind": "hf_decoder", "path": str(path)},
                "data": {"name": "rotten_tomatoes", "max_length": 32}}
    (run_dir / "config.yaml").write_text(json.dumps(settings))
    (run_dir / "summary.json").write_text(json.dumps({"class_names": [], "test_nll": 2.5, "steps": 10}))
    model = build_blocks(config_from_dict(settings), VOCABULARY, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():  # weights far from init, so the logits tell the models apart; the mirror stays the owner
        for parameter in model.parameters():
            parameter.normal_(std=0.3)
        for owner, mirror in model.tied_parameters():
            mirror.copy_(owner)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run_dir / "model.safetensors"))
    run = load_run_model(run_dir)
    prompt, new = "The film is", 12
    continued = continue_prompts(run, [prompt], max_new_tokens=new)[0]
    export_command(run_dir, out, "final")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(exported).__name__ == "GPT2LMHeadModel"
    assert exported.lm_head.weight is exported.transformer.wte.weight
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gap = (exported(input_ids=ids).logits - run.model(ids, torch.ones_like(ids))).abs().max()
    assert gap <= EXACT_ATOL
    generated = exported.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False, eos_token_id=256, pad_token_id=256)[0, ids.shape[1]:].tolist()
    assert tokenizer.decode([t for t in generated if t != 256]) == continued
