"""The blocks a Hugging Face encoder is split into, and the state its encoder computes once for all layers.

Every layer block builds what its attention needs (mask, relative positions, rotary tables) from the int64
padding mask it receives, so only plain tensors cross block, and so pipeline-stage, boundaries.

Encoder-level state from *trainable* parameters (MPNet's relative position bias table, DeBERTa's relative
embeddings and their norm) is owned by the embeddings block and rides the activation: block 0 looks up,
for every position ``p``, the table rows of the signed distances ``+p`` and ``-p`` and repeats them per
sample, ``[batch, length, 2, width]``. Like the hidden states it has a batch dimension and a sequence
dimension, so micro-batching splits it and the cache pads and trims it like any activation; autograd
carries its gradient back across stages to the one copy of the parameters in block 0, which freezes (and
is cached) with layer 0. Each layer block rebuilds the table from the rows of the batch's longest sample
(a sample served from the cache holds zeros past its recorded length, which no real token of a shorter
sample reads) and runs the model's own layer on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "DebertaLayerBlock",
    "HFEmbeddingsBlock",
    "HFLayerBlock",
    "MPNetLayerBlock",
    "ModernBertLayerBlock",
    "RelativeIndex",
    "RelativeRows",
    "RelativeTable",
    "build_mask_once",
    "deberta_rows",
    "mpnet_rows",
]

RelativeRows = Callable[[int, torch.device], torch.Tensor]
"""``rows(length, device)``: per position ``p``, the table rows of the distances ``+p`` and ``-p`` (``[length, 2]``)."""

SIGNS = 2  # rows per position: distance +p, distance -p


def _signed_distances(length: int, device: torch.device) -> torch.Tensor:
    positions = torch.arange(length, device=device)
    return torch.stack([positions, -positions], dim=1)


def mpnet_rows(length: int, device: torch.device, bucket: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """MPNet's bias table row of each distance (key position minus query position): the encoder's own bucketing."""
    return bucket(_signed_distances(length, device))


def deberta_rows(length: int, device: torch.device, relative_positions: Callable[..., torch.Tensor],
                 num_rows: int) -> torch.Tensor:
    """DeBERTa's relative-embedding row of each distance, from the model's own (bucketed) relative positions.

    The layers index the table at ``relative position + num_rows / 2``, clamped to the table (DeBERTa v1
    first slices the table around its middle, which gives the same rows).
    """
    positions = torch.empty(length, 0, device=device)  # only its length is read
    relative = relative_positions(positions, positions)[0]  # [query, key]: query position minus key position
    distances = torch.stack([relative[:, 0], relative[0, :]], dim=1)
    return (distances + num_rows // 2).clamp(0, num_rows - 1)


@dataclass(frozen=True)
class RelativeIndex:
    """Where the entries of an encoder-level table of relative-position entries sit in the carried state."""

    rows: RelativeRows
    num_rows: int

    def table(self, state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The whole table a layer indexes, rebuilt from the batch's longest sample; rows no distance of this
        length reads stay zero. Each row is taken from one position only, so its gradient is counted once."""
        longest = int(attention_mask.sum(dim=1).argmax())
        length, width = state.shape[1], state.shape[-1]
        read = self.rows(length, state.device).reshape(-1)
        unique, inverse = torch.unique(read, return_inverse=True)
        first = torch.full_like(unique, read.numel()).scatter_reduce(
            0, inverse, torch.arange(read.numel(), device=read.device), reduce="amin")
        entries = state[longest].reshape(length * SIGNS, width)[first]
        return entries.new_zeros(self.num_rows, width).index_copy(0, unique, entries)


class RelativeTable(nn.Module):
    """Block 0's share of an encoder-level table of relative-position entries: the rows a sequence reads,
    per position (``+p`` and ``-p``), repeated for every sample. The table (and its norm) belong to block 0."""

    def __init__(self, table: nn.Embedding, rows: RelativeRows, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.table = table
        self.norm = norm if norm is not None else nn.Identity()
        self.index = RelativeIndex(rows, table.num_embeddings)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        entries = self.norm(self.table(self.index.rows(length, hidden.device)))  # the norm is per row: rows commute
        return entries.unsqueeze(0).expand(batch, -1, -1, -1).contiguous()


class HFEmbeddingsBlock(nn.Module):
    """Block 0: token or patch embeddings, then what the encoder computes once before its layers.

    Text passes the padding mask on for the layers to use. ``projection``: an embedding projection the model
    applies outside its embeddings module (ELECTRA's ``embeddings_project``). ``relative``:
    an encoder-level table of relative-position entries whose rows ride the activation. ``masks_embeddings``:
    the embeddings module takes the padding mask (DeBERTa zeroes padded positions).
    """

    def __init__(self, embeddings: nn.Module, task: str, *, projection: nn.Module | None = None,
                 relative: RelativeTable | None = None, masks_embeddings: bool = False) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.task = task
        self.projection = projection
        self.relative = relative
        self.masks_embeddings = masks_embeddings

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if self.task == "image":
            return (self.embeddings(inputs).contiguous(),)
        if attention_mask is None:
            raise ValueError("text embeddings take (input_ids, attention_mask): pass the tokenizer's attention_mask")
        hidden = self.embeddings(input_ids=inputs, **({"mask": attention_mask} if self.masks_embeddings else {}))
        if self.projection is not None:
            hidden = self.projection(hidden)
        state = () if self.relative is None else (self.relative(hidden),)
        return hidden.contiguous(), attention_mask, *state


class _LastMask:
    """Per mask builder, the attention mask built last and what it was built from.

    The whole model builds its mask once a forward; split into blocks, every layer would build it again, and building
    it reads the padding mask on the host (sdpa drops an all-ones mask: ``mask.all()``), which on a GPU is a wait per
    layer a step. The layers of one forward pass the same padding-mask tensor along, so a layer given the very tensor
    (``is``, held here so its id cannot be reused), the same config, attention kernel and hidden shape, dtype and
    device gets the mask built for the layer before it. One entry per builder (ModernBERT alternates two): the next
    forward's mask replaces it."""

    def __init__(self) -> None:
        self.entries: dict[Callable[..., Any], tuple[tuple[Any, ...], torch.Tensor | None, Any]] = {}

    def get(self, build: Callable[..., Any], config: PreTrainedConfig, hidden: torch.Tensor,
            attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        key = (id(config), getattr(config, "_attn_implementation", None), tuple(hidden.shape), hidden.dtype,
               hidden.device)
        entry = self.entries.get(build)
        if entry is not None and attention_mask is not None and entry[1] is attention_mask and entry[0] == key:
            return entry[2]
        mask = build(config=config, inputs_embeds=hidden, attention_mask=attention_mask, **kwargs)
        self.entries[build] = (key, attention_mask, mask)
        return mask


_LAST_MASK = _LastMask()


def build_mask_once(build: Callable[..., Any], config: PreTrainedConfig, hidden: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
    """``build(config=, inputs_embeds=hidden, attention_mask=, **kwargs)``, reused by the next layers of the same
    forward (:class:`_LastMask`); ``kwargs`` must follow from ``hidden``'s shape (the decoder's positions do)."""
    return _LAST_MASK.get(build, config, hidden, attention_mask, **kwargs)


class HFLayerBlock(nn.Module):
    """One encoder layer that turns the int64 padding mask into the mask its attention kernel wants.

    The mask is built by the same transformers function the whole model uses, read from the shared
    config at call time, so eager (additive float mask) and sdpa (boolean mask, or none without
    padding) both match the unsplit model exactly. Encoder-level state after the mask is passed on
    unchanged, except by the last layer (``passes_state=False``): the head takes ``(hidden, mask)``.
    """

    def __init__(self, layer: nn.Module, config: PreTrainedConfig, *, passes_state: bool = False) -> None:
        super().__init__()
        from transformers.masking_utils import create_bidirectional_mask

        self.layer = layer
        self.config = config
        self.passes_state = passes_state
        self._build_mask: Callable[..., Any] = create_bidirectional_mask

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = self.layer_output(hidden, attention_mask, state)
        if isinstance(output, tuple):  # layers of some HF encoders return (hidden, extras...)
            output = output[0]
        output = output.contiguous()
        if attention_mask is None:
            return (output,)
        return (output, attention_mask, *state) if self.passes_state else (output, attention_mask)

    def layer_output(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                     state: tuple[torch.Tensor, ...]) -> Any:
        """The wrapped layer's output (a tensor or a tuple starting with one)."""
        return self.layer(hidden, self._mask(hidden, attention_mask))

    def _mask(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
        return build_mask_once(self._build_mask, self.config, hidden, attention_mask)


class MPNetLayerBlock(HFLayerBlock):
    """An MPNet layer with the relative position bias ``MPNetEncoder.compute_position_bias`` gives every layer,
    computed here from the bias table carried in the activation."""

    def __init__(self, layer: nn.Module, config: PreTrainedConfig, *, bucket: Callable[[torch.Tensor], torch.Tensor],
                 index: RelativeIndex, passes_state: bool) -> None:
        super().__init__(layer, config, passes_state=passes_state)
        self.bucket = bucket
        self.index = index

    def layer_output(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                     state: tuple[torch.Tensor, ...]) -> Any:
        assert attention_mask is not None
        table = self.index.table(state[0], attention_mask)
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        buckets = self.bucket(positions[None, :] - positions[:, None])  # key minus query, as the encoder does
        bias = nn.functional.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)  # [1, heads, query, key]
        return self.layer(hidden, self._mask(hidden, attention_mask), bias)


class DebertaLayerBlock(HFLayerBlock):
    """A DeBERTa (v1 or v2) layer: the encoder's pairwise padding mask, relative positions and relative embeddings
    (rebuilt from the rows carried in the activation), and DeBERTa-v2's convolution after layer 0."""

    def __init__(self, layer: nn.Module, config: PreTrainedConfig, *,
                 relative: tuple[Callable[..., torch.Tensor], RelativeIndex] | None, conv: nn.Module | None,
                 passes_state: bool) -> None:
        super().__init__(layer, config, passes_state=passes_state)
        self.relative = relative  # the model's relative-position function and the carried table, if it has them
        self.conv = conv

    def layer_output(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                     state: tuple[torch.Tensor, ...]) -> Any:
        assert attention_mask is not None
        pairs = attention_mask.unsqueeze(1).unsqueeze(2)
        pairs = pairs * pairs.squeeze(-2).unsqueeze(-1)  # as DebertaEncoder.get_attention_mask: [batch, 1, q, k]
        relative_pos = rel_embeddings = None
        if self.relative is not None:
            relative_positions, index = self.relative
            relative_pos = relative_positions(hidden, hidden)
            rel_embeddings = index.table(state[0], attention_mask)
        output = self.layer(hidden, pairs, relative_pos=relative_pos, rel_embeddings=rel_embeddings)[0]
        if self.conv is not None:
            output = self.conv(hidden, output, attention_mask)
        return output


class ModernBertLayerBlock(HFLayerBlock):
    """A ModernBERT layer: the global or sliding-window mask its attention type wants and the rotary tables
    the model computes once (recomputed here from the model's parameter-free rotary module)."""

    def __init__(self, layer: nn.Module, config: PreTrainedConfig, *, rotary: nn.Module,
                 masks: dict[str, Callable[..., Any]]) -> None:
        super().__init__(layer, config)
        self.rotary = rotary
        self._build_mask = masks[layer.attention_type]

    def layer_output(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                     state: tuple[torch.Tensor, ...]) -> Any:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary(hidden, positions, self.layer.attention_type)
        return self.layer(hidden, attention_mask=self._mask(hidden, attention_mask), position_embeddings=rotary)
