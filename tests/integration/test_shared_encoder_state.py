"""Encoder-level trainable state on real gloo workers trains exactly as one process does.

DeBERTa-v2 (relative embeddings and their norm, used by every layer, owned by the embeddings block) on a
2-stage pipeline: the state rides the activation, so its gradient comes back from the layers of both
stages through the pipeline's own activation gradients; losing any of it would leave the table (and the
optimizer state the comparison includes) different from the single-process run's. MPNet (its position
bias table) frozen with layer 0 mid-training and served from the cache on a pipeline: the table stops
training and the cached prefix, state included, feeds the stages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import assert_close_states, optimizer_state, run_job, summary, weights

pytestmark = pytest.mark.slow

RTOL = 2e-4
ATOL = 1e-7
TEXT = "tiny_text.yaml"
SAVE = ("run.save_model=true",)
PIPELINE = ("pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=4")
DEBERTA_V3_SHAPE = (
    "model.hf_config.model_type=deberta-v2", "model.hf_config.relative_attention=true",
    "model.hf_config.pos_att_type=[p2c, c2p]", "model.hf_config.position_buckets=8",
    "model.hf_config.norm_rel_ebd=layer_norm", "model.hf_config.share_att_key=true",
    "model.attn_implementation=eager", "train.max_steps=4",
)
FIRST_LAYER_BLOCK = 1
SHARED = ("blocks.0.relative.table.weight", "blocks.0.relative.norm.weight", "blocks.0.relative.norm.bias")
MPNET_FROZEN_AND_CACHED = (
    "model.hf_config.model_type=mpnet", "model.attn_implementation=eager", "train.max_steps=5",
    "freeze.enabled=true", "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[2,2]]",
    "cache.enabled=true",
)
MPNET_TABLE = "blocks.0.relative.table.weight"


def test_deberta_v2_pipeline_matches_single_process(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run_job(TEXT, reference, *SAVE, *DEBERTA_V3_SHAPE)
    piped = tmp_path / "piped"
    run_job(TEXT, piped, *SAVE, *DEBERTA_V3_SHAPE, *PIPELINE, nproc=2)
    (first, second) = summary(piped)["layout_history"][0]["bounds"]
    layers = range(FIRST_LAYER_BLOCK, second[1] - 1)  # blocks 1..L; the head is the last block
    assert any(b in layers for b in range(*first)) and any(b in layers for b in range(*second)), \
        f"layers using the shared state must sit on both stages: {first}, {second}"
    assert all(name in weights(piped) for name in SHARED), sorted(weights(piped))[:8]
    assert all(f"{name}.exp_avg" in optimizer_state(piped) for name in SHARED), "the shared state did not train"
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)


def test_mpnet_table_frozen_and_cached_on_a_pipeline_matches_single_process(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run_job(TEXT, reference, *SAVE, *MPNET_FROZEN_AND_CACHED)
    piped = tmp_path / "piped"
    run_job(TEXT, piped, *SAVE, *MPNET_FROZEN_AND_CACHED, *PIPELINE, nproc=2)
    history = summary(piped)["layout_history"]
    assert [(h["stages"], h["cached_blocks"]) for h in history] == [(2, 0), (2, 3)]
    assert f"{MPNET_TABLE}.exp_avg" not in optimizer_state(piped), "the table kept training after layer 0 froze"
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)
