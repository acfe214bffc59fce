"""``pipetransformer export RUN_DIR OUT``: a trained Hugging Face text model as a directory transformers loads.

``OUT`` holds the fine-tuned encoder as ``save_pretrained`` writes it (``AutoModel.from_pretrained(OUT)`` loads
it, with ``id2label`` naming the classes), its tokenizer, and the classification head the encoder's
``last_hidden_state`` goes through: ``head.safetensors`` (a linear ``classifier``) and ``head.json`` (the pooling
over tokens and the class names). :func:`load_exported` puts the two back together::

    from pipetransformer.export import load_exported
    model, tokenizer = load_exported("exported")
    logits = model(**tokenizer(["a fine film"], return_tensors="pt", return_token_type_ids=False))

The block model's head applies a final norm only where it is the encoder's own (then ``last_hidden_state``
already has it), so pooling and the classifier are all the head adds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetransformer.config import ConfigError

__all__ = ["ExportedClassifier", "HEAD_CONFIG_FILE", "HEAD_WEIGHTS_FILE", "export_command", "load_exported"]

HEAD_WEIGHTS_FILE = "head.safetensors"
HEAD_CONFIG_FILE = "head.json"
CLASSIFIER_PREFIX = "classifier."


class ExportedClassifier(nn.Module):
    """A transformers encoder and the run's head: ``(input_ids, attention_mask) -> logits``."""

    def __init__(self, encoder: nn.Module, head: nn.Module, class_names: list[str]) -> None:
        super().__init__()
        self.encoder, self.head, self.class_names = encoder, head, class_names

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits: torch.Tensor = self.head(hidden, attention_mask)[0]
        return logits


def export_command(run_dir: Path, out: Path, weights: str) -> int:
    from safetensors.torch import save_file

    from safetensors.torch import load_file

    from pipetransformer.models import load_tokenizer, minilm_path
    from pipetransformer.models.hf import blocks_from_hf, load_hf_encoder, quiet_transformers
    from pipetransformer.predict import read_run

    config, summary, weights_file = read_run(run_dir, weights)
    m, class_names = config.model, list(summary["class_names"])
    if m.kind == "vit":
        raise ConfigError("export writes Hugging Face models; a built-in ViT (model.kind: vit) is used as it is: "
                          f"pipetransformer predict {run_dir} --input FOLDER, or build_vit + {weights_file}")
    path = m.path or (minilm_path() if m.kind == "minilm" else None)
    encoder = load_hf_encoder(path=path, config=None if path else m.hf_config,
                              attn_implementation=m.attn_implementation)
    blocks = blocks_from_hf(encoder, len(class_names), pooling=m.pooling)  # holds the encoder's own modules
    with torch.no_grad():
        blocks.load_state_dict(load_file(str(weights_file)))
    encoder.config.id2label = dict(enumerate(class_names))
    encoder.config.label2id = {name: index for index, name in enumerate(class_names)}
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        encoder.save_pretrained(out)
    load_tokenizer(path or minilm_path()).save_pretrained(out)  # random-weight models borrow MiniLM's, as in training
    head = blocks.blocks[-1]
    save_file({name: tensor.contiguous() for name, tensor in head.state_dict().items()
               if name.startswith(CLASSIFIER_PREFIX)}, str(out / HEAD_WEIGHTS_FILE))
    (out / HEAD_CONFIG_FILE).write_text(json.dumps({"pooling": m.pooling, "class_names": class_names}, indent=2))
    print(f"exported to {out}: AutoModel.from_pretrained({str(out)!r}) loads the encoder, "
          f"pipetransformer.export.load_exported({str(out)!r}) the classifier")
    return 0


def load_exported(directory: str | Path) -> tuple[ExportedClassifier, Any]:
    """The classifier and tokenizer ``export`` wrote to ``directory``, in eval mode."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    from pipetransformer.models.heads import TextClassificationHead
    from pipetransformer.models.hf import quiet_transformers

    folder = Path(directory)
    settings = json.loads((folder / HEAD_CONFIG_FILE).read_text())
    with quiet_transformers():
        encoder = AutoModel.from_pretrained(folder, local_files_only=True)
    head = TextClassificationHead(encoder.config.hidden_size, len(settings["class_names"]), pooling=settings["pooling"])
    head.load_state_dict(load_file(str(folder / HEAD_WEIGHTS_FILE)))
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return ExportedClassifier(encoder, head, settings["class_names"]).eval(), tokenizer
