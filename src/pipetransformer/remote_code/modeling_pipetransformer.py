"""An exported PipeTransformer text classifier: the encoder, pooling over tokens, one linear layer.

Exactly the head ``pipetransformer train`` trained (``models/heads.py``'s ``TextClassificationHead``), which no standard
``...ForSequenceClassification`` class has (BERT's pools the first token through a dense layer and tanh). Shipped inside
the exported directory by ``pipetransformer export``; imports ``torch`` and ``transformers`` only::

    AutoModelForSequenceClassification.from_pretrained(directory, trust_remote_code=True)
    pipeline("text-classification", model=directory, trust_remote_code=True)
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from .configuration_pipetransformer import PipeTransformerTextConfig

CLASS_TOKEN_INDEX = 0


class PipeTransformerForSequenceClassification(PreTrainedModel):
    """``(input_ids, attention_mask) -> logits`` of the trained head; ``labels`` give the cross-entropy loss."""

    config_class = PipeTransformerTextConfig
    base_model_prefix = "encoder"

    def __init__(self, config: PipeTransformerTextConfig) -> None:
        super().__init__(config)
        encoder_config = AutoConfig.for_model(**config.encoder)
        self.encoder = AutoModel.from_config(encoder_config)
        self.classifier = nn.Linear(encoder_config.hidden_size, config.num_labels)
        self._takes_token_types = "token_type_ids" in inspect.signature(self.encoder.forward).parameters
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Loading overwrites every weight; a fresh instance gets the encoder's own initialisation."""
        if module is self.classifier:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and self._takes_token_types:
            inputs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**inputs).last_hidden_state
        if self.config.pooling == "cls":
            pooled = hidden[:, CLASS_TOKEN_INDEX]
        else:  # the mean over the real tokens: padding never changes a prediction
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        logits = self.classifier(pooled)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)
