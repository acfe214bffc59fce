"""Cluster and model descriptions: presets, files and HF configs validated with one-line errors; the
memory savers (bf16, recomputation) in the cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetransformer.pipe.cost import (
    BlockCost,
    BlockState,
    BlockWork,
    Precision,
    analytic_work,
    costs_from_work,
    recomputed,
    stage_memory,
)
from pipetransformer.pipe.profile import ANALYTIC_FLOPS_PER_SECOND
from pipetransformer.plan.cluster import (
    CLUSTER_FIELDS,
    PRESETS,
    ClusterError,
    calibrated_flops,
    cluster_from_mapping,
    load_cluster,
)
from pipetransformer.plan.model_spec import (
    BUILT_IN_MODELS,
    ModelSpec,
    ModelSpecError,
    load_model_spec,
    model_from_hf_config,
)

A = BlockState.ACTIVE
VIT_B16_PARAMS = 86_567_656
"""timm's vit_base_patch16_224 (1000 classes); the analytic count lacks only the class token (768)."""


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# --- clusters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate(name: str) -> None:
    cluster = load_cluster(name)
    assert cluster.world_size == PRESETS[name]["nodes"] * PRESETS[name]["devices_per_node"]
    assert cluster.device.fp32_flops > 0 and cluster.device.memory_bytes > 0


def test_paper_cluster() -> None:
    paper = load_cluster("paper")
    assert (paper.nodes, paper.devices_per_node, paper.device.memory_bytes) == (2, 8, 16e9)
    assert paper.device.flops(Precision.BF16) is None, "Turing has no bf16"
    assert paper.inter_node.bandwidth_bytes_per_s == 5e9
    assert paper.link_between(0, 7) is paper.intra_node and paper.link_between(7, 8) is paper.inter_node
    assert paper.spans_nodes([3, 11]) and not paper.spans_nodes([0, 1])
    assert load_cluster("h100x8").device.flops(Precision.BF16) > load_cluster("a100x8").device.flops(Precision.BF16)


@pytest.mark.parametrize(("change", "names"), [
    ({"nodes": 0}, ("nodes", "integer >= 1")),
    ({"nodes": 1.5}, ("nodes", "integer")),
    ({"devices_per_node": True}, ("devices_per_node",)),
    ({"memory_gb": -16}, ("memory_gb", "> 0", "GB")),
    ({"fp32_tflops": "fast"}, ("fp32_tflops", "number")),
    ({"inter_node_latency_us": -1}, ("inter_node_latency_us", ">= 0")),
    ({"name": ""}, ("name", "non-empty")),
    ({"memory_gbs": 16}, ("unknown field 'memory_gbs'", "memory_gb")),
])
def test_cluster_fields_are_validated_in_one_line(change: dict[str, object], names: tuple[str, ...]) -> None:
    fields = {**PRESETS["paper"], **change}
    with pytest.raises(ClusterError) as error:
        cluster_from_mapping(fields, source="mine.yaml")
    message = one_line(error)
    assert message.startswith("mine.yaml: ")
    assert all(name in message for name in names), message


def test_missing_field_names_it_and_its_unit() -> None:
    fields = {k: v for k, v in PRESETS["paper"].items() if k != "inter_node_gb_s"}
    with pytest.raises(ClusterError, match="missing field 'inter_node_gb_s'.*GB/s"):
        cluster_from_mapping(fields)


def test_bf16_may_be_null_but_latency_zero() -> None:
    cluster = cluster_from_mapping({**PRESETS["a100x8"], "bf16_tflops": None, "intra_node_latency_us": 0})
    assert cluster.device.bf16_flops is None and cluster.intra_node.latency_s == 0


def test_cluster_files(tmp_path: Path) -> None:
    as_json = tmp_path / "cluster.json"
    as_json.write_text(json.dumps(PRESETS["h100x8"]))
    assert load_cluster(str(as_json)) == load_cluster("h100x8")
    as_yaml = tmp_path / "cluster.yaml"
    as_yaml.write_text("\n".join(f"{key}: {json.dumps(value)}" for key, value in PRESETS["paper"].items()))
    assert load_cluster(str(as_yaml)) == load_cluster("paper")
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [1\n")
    with pytest.raises(ClusterError, match="not valid YAML") as error:
        load_cluster(str(broken))
    one_line(error)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(ClusterError, match="expected a mapping"):
        load_cluster(str(listed))
    with pytest.raises(ClusterError, match="neither a preset") as error:
        load_cluster(str(tmp_path / "nowhere.yaml"))
    assert "paper" in one_line(error)
    with pytest.raises(ClusterError, match="pass the config"):
        load_cluster("local")
    assert set(CLUSTER_FIELDS) == set(PRESETS["paper"])


def test_calibration_recovers_the_rate_analytic_costs_assumed() -> None:
    work = analytic_work(num_layers=3, hidden_size=32, seq_len=8, num_heads=4, vocab_size=100, num_classes=2)
    measured = costs_from_work(work, flops_per_second=ANALYTIC_FLOPS_PER_SECOND)
    assert calibrated_flops(work, measured) == pytest.approx(ANALYTIC_FLOPS_PER_SECOND)
    with pytest.raises(ClusterError, match="same blocks"):
        calibrated_flops(work, measured[:-1])


# --- models -----------------------------------------------------------------------------------


def test_built_in_models() -> None:
    vit = BUILT_IN_MODELS["vit-b16"]
    assert (vit.num_layers, vit.hidden_size, vit.seq_len) == (12, 768, 197)
    assert sum(w.params for w in vit.work()) == pytest.approx(VIT_B16_PARAMS, rel=1e-4)
    bert = BUILT_IN_MODELS["bert-large"]
    assert (bert.num_layers, bert.hidden_size, bert.seq_len) == (24, 1024, 384)
    assert len(bert.work()) == bert.num_blocks == 26
    rows = bert.describe_blocks(Precision.FP32, optimizer_state_factor=2)
    assert rows[1]["optimizer_bytes"] == 2 * rows[1]["param_bytes"] == 2 * rows[1]["gradient_bytes"]
    assert rows[1]["forward_gflops"] > rows[0]["forward_gflops"]


def test_model_from_hf_configs() -> None:
    vit = model_from_hf_config({"model_type": "vit", "image_size": 224, "patch_size": 16, "hidden_size": 768,
                                "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072})
    assert vit.work() == BUILT_IN_MODELS["vit-b16"].work()
    text = model_from_hf_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "vocab_size": 100, "max_position_embeddings": 32}, seq_len=16)
    assert text.is_text and text.seq_len == 16 and text.intermediate_size == 4 * 64


@pytest.mark.parametrize(("config", "kwargs", "names"), [
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}, {}, ("missing 'hidden_size'",)),
    ({"hidden_size": "wide", "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}, {},
     ("hidden_size", "integer")),
    ({"hidden_size": 30, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}, {},
     ("not a multiple", "num_heads")),
    ({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10,
      "max_position_embeddings": 8}, {"seq_len": 16}, ("seq_len=16", "max_position_embeddings=8")),
    ({"hidden_size": 32, "num_hidden_layers": 0, "num_attention_heads": 4, "vocab_size": 10}, {},
     ("num_layers", ">= 1")),
    ({"model_type": "vit", "image_size": 30, "patch_size": 16, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 4}, {}, ("image_size=30", "patch_size=16")),
])
def test_model_configs_are_validated_in_one_line(config: dict[str, object], kwargs: dict[str, int],
                                                 names: tuple[str, ...]) -> None:
    with pytest.raises(ModelSpecError) as error:
        model_from_hf_config(config, name="cfg.json", **kwargs)  # type: ignore[arg-type]
    message = one_line(error)
    assert all(name in message for name in names), message


def test_load_model_spec(tmp_path: Path) -> None:
    assert load_model_spec("bert-base", seq_len=256).seq_len == 256
    with pytest.raises(ModelSpecError, match="fixed"):
        load_model_spec("vit-b16", seq_len=128)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "vocab_size": 50}))
    assert load_model_spec(str(tmp_path)).num_layers == 2
    with pytest.raises(ModelSpecError, match="neither a built-in model.*vit-b16") as error:
        load_model_spec("gpt-9")
    one_line(error)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        load_model_spec(str(tmp_path / "bad.json"))


def test_spec_dimensions_are_checked() -> None:
    with pytest.raises(ModelSpecError, match="seq_len must be an integer >= 1"):
        ModelSpec("m", 2, 32, 4, 128, 0, 10, 2, is_text=True)


# --- memory savers in the cost model ----------------------------------------------------------


WORK = BlockWork(forward_flops=2e9, memory_elements=1e6, params=1000, saved_elements=500, output_elements=100,
                 output_extra_bytes=8)


def test_bf16_halves_activations_and_messages_but_not_weights() -> None:
    fp32, = costs_from_work([WORK], flops_per_second=1e12, memory_bytes_per_second=1e11)
    bf16, = costs_from_work([WORK], flops_per_second=4e12, memory_bytes_per_second=1e11, precision=Precision.BF16)
    assert fp32.forward_s == pytest.approx(2e9 / 1e12 + 4e6 / 1e11)
    assert bf16.forward_s == pytest.approx(2e9 / 4e12 + 2e6 / 1e11)
    assert bf16.backward_s == pytest.approx(2 * bf16.forward_s)
    assert (fp32.activation_bytes, bf16.activation_bytes) == (2000, 1000)
    assert (fp32.output_bytes, bf16.output_bytes) == (408, 208), "the int64 mask does not shrink"
    assert fp32.param_bytes == bf16.param_bytes == 4000


def test_recomputation_keeps_the_input_and_pays_a_forward() -> None:
    cost = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=10, param_bytes=100, activation_bytes=70)
    again = recomputed(cost, input_bytes=10)
    assert (again.forward_s, again.backward_s, again.activation_bytes, again.recompute_bytes) == (1.0, 3.0, 10, 70)
    assert recomputed(again, input_bytes=10) == again
    per_call = recomputed(BlockCost(1.0, 2.0, 10, 100, 70, forward_fixed_s=0.5, backward_fixed_s=0.25), 10)
    assert (per_call.forward_fixed_s, per_call.backward_fixed_s) == (0.5, 0.75), "the re-run forward's calls too"
    costs = [again, again, cost]
    # params + grads + 2 AdamW moments; 3 micro-batches of 2 held; one recomputed block rebuilt for one micro-batch
    weights = 3 * 100 * 4
    held = (10 + 10 + 70) * 2 * 3
    assert stage_memory(costs, [A] * 3, 0, 3, micro_batch_size=2, in_flight_micro_batches=3) == \
        weights + held + 70 * 2
    frozen = [BlockState.FROZEN, A, A]
    assert stage_memory(costs, frozen, 0, 1, micro_batch_size=2) == 100, "a frozen block rebuilds nothing"
