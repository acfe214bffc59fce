"""A tiny block model and image data set for the trainer components' tests: milliseconds per step."""

from __future__ import annotations

import torch
from torch import nn

from pipetransformer.config import CacheConfig, DPConfig, PipeConfig
from pipetransformer.data.images import ImageDataset
from pipetransformer.distributed import DistEnv
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.autocache import AutoCache
from pipetransformer.train.elastic import ElasticLayout
from pipetransformer.train.step import StepContext
from pipetransformer.train.task import Task, classification

PIXELS = (1, 2, 2)
WIDTH = 8
LAYERS = 3
CLASSES = 3
ROWS = 24
MAX_LENGTH = 8  # unused by images; what a text data set would pad to
CPU = torch.device("cpu")


def tiny_model(seed: int = 0, outputs: int = CLASSES) -> BlockSequence:
    torch.manual_seed(seed)
    embeddings = nn.Sequential(nn.Flatten(), nn.Linear(PIXELS[0] * PIXELS[1] * PIXELS[2], WIDTH))
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    return BlockSequence(embeddings, layers, nn.Linear(WIDTH, outputs), task="image")


class ForwardCount(nn.Module):
    """Identity that counts its forwards. Put it first in a layer: recomputation stops after the last op that
    saved a tensor, and module hooks do not fire in it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def tiny_dropout_model(seed: int = 0) -> BlockSequence:
    """The tiny model with dropout in every layer (recomputation must draw the same masks again), each layer
    counting its forwards in a :class:`ForwardCount` at ``layer[0]``."""
    model = tiny_model(seed)
    for layer in model.blocks[1:-1]:
        layer.insert(0, ForwardCount())
        layer.append(nn.Dropout(0.5))
    return model


BF16_GRADIENT_RTOL = 2e-2
"""Relative gradient error allowed for a bf16 forward (8 significant bits) on the tiny model; measured <= 0.8%."""


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    assert float((got - want).norm()) <= BF16_GRADIENT_RTOL * float(want.norm()) + 1e-6, msg


def tiny_dataset(rows: int = ROWS, seed: int = 1) -> ImageDataset:
    generator = torch.Generator().manual_seed(seed)
    return ImageDataset(torch.randn(rows, *PIXELS, generator=generator),
                        torch.randint(0, CLASSES, (rows,), generator=generator),
                        [f"class {i}" for i in range(CLASSES)])


def env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, device=CPU,
                   backend="gloo")


def layout(model: BlockSequence, dataset: ImageDataset, dist_env: DistEnv, *, pipe: PipeConfig | None = None,
           dp: DPConfig | None = None, cache: CacheConfig | None = None, batch_size: int = 8,
           task: Task | None = None) -> ElasticLayout:
    """An elastic layout over the tiny model, its cache off unless ``cache`` says otherwise."""
    autocache = AutoCache(model, dist_env, cache or CacheConfig(), train_set=dataset, eval_samples=0,
                          max_length=MAX_LENGTH)
    context = StepContext(model, task or classification(), dataset, MAX_LENGTH, CPU, autocache)
    return ElasticLayout(context, dist_env, pipe=pipe or PipeConfig(), dp=dp or DPConfig(), batch_size=batch_size)
