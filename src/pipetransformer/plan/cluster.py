"""Clusters the planner can predict for: nodes x devices, each device's memory and speed, and the links.

A cluster is described in human units (GB, TFLOP/s, GB/s, microseconds) by a flat mapping, the same
for the built-in presets and for a YAML/JSON file, so both go through one validation with one-line
errors. Presets:

- ``paper``: the PipeTransformer paper's testbed (He et al., ICML 2021, Section 5): 2 nodes x 8 NVIDIA
  Quadro RTX 5000 (16 GB each), GPUs in a node on PCIe 3.0 x16, nodes joined by InfiniBand CX353A at
  5 GB/s. Turing has no bf16, so that lever is unavailable there.
- ``a100x8``: one node of 8 A100-SXM4-80GB on NVLink 3.
- ``h100x8``: one node of 8 H100 SXM (80 GB) on NVLink 4.
- ``local``: this machine (:func:`local_cluster`), whose speed comes from profiling, not from a table.

Sustained rates are datasheet peaks times an assumed efficiency (:data:`COMPUTE_EFFICIENCY`,
:data:`MEMORY_EFFICIENCY`, :data:`LINK_EFFICIENCY`): the planner's sensitivity to them is part of
``benchmarks/planner``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from pipetransformer.pipe.cost import BlockCost, BlockWork, Link, Precision

__all__ = [
    "CLUSTER_FIELDS",
    "PRESETS",
    "Cluster",
    "ClusterError",
    "Device",
    "calibrated_flops",
    "cluster_from_mapping",
    "load_cluster",
    "local_cluster",
]

TERA = 1e12
GIGA = 1e9
MICRO = 1e-6
MILLI = 1e-3

COMPUTE_EFFICIENCY = 0.6
"""Assumed share of the datasheet's peak FLOP/s that transformer training sustains (large matmuls reach
70-80%, attention and small ops far less)."""

MEMORY_EFFICIENCY = 0.8
"""Assumed share of the datasheet's memory bandwidth that streaming element-wise kernels sustain."""

LINK_EFFICIENCY = 0.8
"""Assumed share of a link's one-direction datasheet bandwidth that NCCL point-to-point and ring
all-reduce sustain."""

PCIE3_X16_GB_S = 15.75
"""PCIe 3.0 x16, one direction: 16 lanes x 8 GT/s x 128/130."""

PCIE4_X16_GB_S = 31.5
PCIE5_X16_GB_S = 63.0
"""Host links of A100 (PCIe 4.0) and H100 (PCIe 5.0) nodes, one direction."""

NVLINK3_GB_S = 300.0
"""A100 NVLink 3: 600 GB/s per GPU, both directions together."""

NVLINK4_GB_S = 450.0
"""H100 NVLink 4: 900 GB/s per GPU, both directions together."""

PAPER_INFINIBAND_GB_S = 5.0
"""The paper's inter-node InfiniBand CX353A, as the paper states it (taken as achieved)."""

HDR_INFINIBAND_GB_S = 25.0
NDR_INFINIBAND_GB_S = 50.0
"""200 and 400 Gb/s InfiniBand, for A100 and H100 nodes (used only when a cluster has several nodes)."""

PCIE_LATENCY_US = 10.0
NVLINK_LATENCY_US = 5.0
INFINIBAND_LATENCY_US = 10.0
"""Per-message latency including the communication library's launch, an assumption per link kind."""

GPU_MICRO_BATCH_OVERHEAD_MS = 1.0
"""Assumed fixed cost of one stage running one micro-batch on a GPU (Python schedule, kernel launches)."""

CLUSTER_FIELDS: dict[str, str] = {
    "name": "a label",
    "nodes": "number of nodes (integer >= 1)",
    "devices_per_node": "devices per node (integer >= 1)",
    "device": "device model, a label",
    "memory_gb": "memory per device, GB",
    "fp32_tflops": "sustained fp32 TFLOP/s per device",
    "bf16_tflops": "sustained bf16 TFLOP/s per device, or null when the device has no bf16",
    "memory_bandwidth_gb_s": "sustained device-memory bandwidth, GB/s",
    "intra_node_gb_s": "device-to-device bandwidth inside a node, one direction, GB/s",
    "intra_node_latency_us": "device-to-device message latency inside a node, microseconds",
    "inter_node_gb_s": "bandwidth between nodes (one node's network interface, shared by its devices), GB/s",
    "inter_node_latency_us": "message latency between nodes, microseconds",
    "host_to_device_gb_s": "host memory to one device (where cached activations come from), GB/s",
    "micro_batch_overhead_ms": "fixed cost of one stage running one micro-batch, milliseconds",
}
"""Every field of a cluster description and its unit; all are required."""

_OPTIONAL_NULL = {"bf16_tflops"}
_LABELS = {"name", "device"}
_INTEGERS = {"nodes", "devices_per_node"}
_MAY_BE_ZERO = {"intra_node_latency_us", "inter_node_latency_us", "micro_batch_overhead_ms"}


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message names the field and what to change."""


@dataclass(frozen=True)
class Device:
    """One accelerator: memory and sustained speeds (SI units)."""

    name: str
    memory_bytes: float
    fp32_flops: float
    bf16_flops: float | None
    memory_bytes_per_s: float

    def flops(self, precision: Precision) -> float | None:
        """Sustained FLOP/s in ``precision``, None when the device does not support it."""
        return self.fp32_flops if precision is Precision.FP32 else self.bf16_flops


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices. Rank ``r`` is on node ``r // devices_per_node``."""

    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link
    host_to_device: Link
    micro_batch_overhead_s: float

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ClusterError(f"rank {rank} is outside 0..{self.world_size - 1} of cluster {self.name}")
        return rank // self.devices_per_node

    def link_between(self, rank_a: int, rank_b: int) -> Link:
        return self.intra_node if self.node_of(rank_a) == self.node_of(rank_b) else self.inter_node

    def spans_nodes(self, ranks: list[int]) -> bool:
        return len({self.node_of(rank) for rank in ranks}) > 1

    def describe(self) -> str:
        bf16 = "no bf16" if self.device.bf16_flops is None else f"bf16 {self.device.bf16_flops / TERA:.0f} TFLOP/s"
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {self.device.name} "
                f"({self.device.memory_bytes / GIGA:g} GB, fp32 {self.device.fp32_flops / TERA:.1f} TFLOP/s, {bf16}), "
                f"intra-node {self.intra_node.bandwidth_bytes_per_s / GIGA:g} GB/s, "
                f"inter-node {self.inter_node.bandwidth_bytes_per_s / GIGA:g} GB/s")


def _number(source: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClusterError(f"{source}: {key} must be a number ({CLUSTER_FIELDS[key]}), got {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
        bound = ">= 0" if key in _MAY_BE_ZERO else "> 0"
        raise ClusterError(f"{source}: {key} must be {bound} ({CLUSTER_FIELDS[key]}), got {value!r}")
    return float(value)


def cluster_from_mapping(fields: Mapping[str, Any], source: str = "cluster") -> Cluster:
    """A cluster from its description in human units (see :data:`CLUSTER_FIELDS`); ``source`` names it in errors."""
    if not isinstance(fields, Mapping):
        raise ClusterError(f"{source}: expected a mapping of cluster fields ({', '.join(CLUSTER_FIELDS)}), "
                           f"got {type(fields).__name__}")
    unknown = sorted(set(fields) - set(CLUSTER_FIELDS))
    if unknown:
        raise ClusterError(f"{source}: unknown field {unknown[0]!r} (allowed: {', '.join(CLUSTER_FIELDS)})")
    missing = [key for key in CLUSTER_FIELDS if key not in fields]
    if missing:
        raise ClusterError(f"{source}: missing field {missing[0]!r}: add it ({CLUSTER_FIELDS[missing[0]]})")
    for key in _LABELS:
        if not isinstance(fields[key], str) or not fields[key]:
            raise ClusterError(f"{source}: {key} must be a non-empty string, got {fields[key]!r}")
    for key in _INTEGERS:
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ClusterError(f"{source}: {key} must be an integer >= 1 ({CLUSTER_FIELDS[key]}), got {value!r}")
    numbers = {key: _number(source, key, fields[key]) for key in CLUSTER_FIELDS
               if key not in _LABELS | _INTEGERS and not (key in _OPTIONAL_NULL and fields[key] is None)}
    bf16 = numbers.get("bf16_tflops")
    return Cluster(
        name=fields["name"],
        nodes=fields["nodes"],
        devices_per_node=fields["devices_per_node"],
        device=Device(
            name=fields["device"],
            memory_bytes=numbers["memory_gb"] * GIGA,
            fp32_flops=numbers["fp32_tflops"] * TERA,
            bf16_flops=None if bf16 is None else bf16 * TERA,
            memory_bytes_per_s=numbers["memory_bandwidth_gb_s"] * GIGA,
        ),
        intra_node=Link(numbers["intra_node_gb_s"] * GIGA, numbers["intra_node_latency_us"] * MICRO),
        inter_node=Link(numbers["inter_node_gb_s"] * GIGA, numbers["inter_node_latency_us"] * MICRO),
        host_to_device=Link(numbers["host_to_device_gb_s"] * GIGA),
        micro_batch_overhead_s=numbers["micro_batch_overhead_ms"] * MILLI,
    )


RTX5000_FP32_TFLOPS = 11.2
RTX5000_MEMORY_GB_S = 448.0
A100_FP32_TFLOPS = 19.5
A100_BF16_TFLOPS = 312.0
A100_MEMORY_GB_S = 2039.0
H100_FP32_TFLOPS = 67.0
H100_BF16_TFLOPS = 989.0
H100_MEMORY_GB_S = 3350.0
"""Datasheet peaks (dense tensor-core rates for bf16)."""

class _Datasheet(NamedTuple):
    """One built-in GPU node type: datasheet peaks (links one direction) that :func:`_preset` derates."""

    name: str
    nodes: int
    device: str
    memory_gb: float
    fp32_tflops: float
    bf16_tflops: float | None
    memory_gb_s: float
    intra_node_gb_s: float
    intra_node_latency_us: float
    inter_node_achieved_gb_s: float
    host_to_device_gb_s: float


def _preset(sheet: _Datasheet) -> dict[str, Any]:
    """The cluster file's fields for a node type, with the assumed efficiencies applied."""
    return {
        "name": sheet.name, "nodes": sheet.nodes, "devices_per_node": 8, "device": sheet.device,
        "memory_gb": sheet.memory_gb, "fp32_tflops": sheet.fp32_tflops * COMPUTE_EFFICIENCY,
        "bf16_tflops": None if sheet.bf16_tflops is None else sheet.bf16_tflops * COMPUTE_EFFICIENCY,
        "memory_bandwidth_gb_s": sheet.memory_gb_s * MEMORY_EFFICIENCY,
        "intra_node_gb_s": sheet.intra_node_gb_s * LINK_EFFICIENCY,
        "intra_node_latency_us": sheet.intra_node_latency_us,
        "inter_node_gb_s": sheet.inter_node_achieved_gb_s, "inter_node_latency_us": INFINIBAND_LATENCY_US,
        "host_to_device_gb_s": sheet.host_to_device_gb_s * LINK_EFFICIENCY,
        "micro_batch_overhead_ms": GPU_MICRO_BATCH_OVERHEAD_MS,
    }


PRESETS: dict[str, dict[str, Any]] = {sheet.name: _preset(sheet) for sheet in (
    _Datasheet("paper", 2, "Quadro RTX 5000", 16.0, RTX5000_FP32_TFLOPS, None, RTX5000_MEMORY_GB_S,
               PCIE3_X16_GB_S, PCIE_LATENCY_US, PAPER_INFINIBAND_GB_S, PCIE3_X16_GB_S),
    _Datasheet("a100x8", 1, "A100-SXM4-80GB", 80.0, A100_FP32_TFLOPS, A100_BF16_TFLOPS, A100_MEMORY_GB_S,
               NVLINK3_GB_S, NVLINK_LATENCY_US, HDR_INFINIBAND_GB_S * LINK_EFFICIENCY, PCIE4_X16_GB_S),
    _Datasheet("h100x8", 1, "H100-SXM5-80GB", 80.0, H100_FP32_TFLOPS, H100_BF16_TFLOPS, H100_MEMORY_GB_S,
               NVLINK4_GB_S, NVLINK_LATENCY_US, NDR_INFINIBAND_GB_S * LINK_EFFICIENCY, PCIE5_X16_GB_S),
)}
"""Built-in clusters in the file format; ``local`` is not among them because it is measured (:func:`local_cluster`)."""

LOCAL = "local"


def calibrated_flops(work: Sequence[BlockWork], measured: Sequence[BlockCost]) -> float:
    """The FLOP/s this machine sustains on a model's layers: their analytic FLOPs over their measured
    forward time (layers only: embeddings and head are dominated by other costs)."""
    if len(work) != len(measured) or len(work) < 3:
        raise ClusterError(f"calibration needs the same blocks analysed and measured (embeddings, layers, head), "
                           f"got {len(work)} and {len(measured)}")
    seconds = sum(cost.forward_s for cost in measured[1:-1])
    if seconds <= 0:
        raise ClusterError("the profiled layers took no time: profile with a larger batch")
    return sum(block.forward_flops for block in work[1:-1]) / seconds


def local_cluster(world_size: int, *, memory_gb: float | None, link_bandwidth_gb_s: float,
                  flops_per_second: float, micro_batch_overhead_s: float) -> Cluster:
    """This machine as ``world_size`` workers on one node.

    Its speed is whatever profiling measured (``flops_per_second`` is calibrated from profiled blocks);
    memory traffic is already inside that measurement, so it is not charged again. No bf16 lever: the
    CPU kernels here are not faster in bf16.
    """
    fields = {
        "name": LOCAL, "nodes": 1, "devices_per_node": world_size, "device": "this machine (profiled)",
        "memory_gb": math.inf if memory_gb is None else memory_gb, "fp32_tflops": flops_per_second / TERA,
        "bf16_tflops": None, "memory_bandwidth_gb_s": math.inf, "intra_node_gb_s": link_bandwidth_gb_s,
        "intra_node_latency_us": 0.0, "inter_node_gb_s": link_bandwidth_gb_s, "inter_node_latency_us": 0.0,
        "host_to_device_gb_s": math.inf,
        "micro_batch_overhead_ms": micro_batch_overhead_s / MILLI,
    }
    return cluster_from_mapping(fields, source="cluster local")


def read_json_file(path: Path, error: type[ValueError], missing: str) -> Any:
    """The JSON in the file ``path``: ``error(missing)`` where there is none, an ``error`` naming the line where it is
    not JSON (what ``--model`` and ``--freeze`` read)."""
    if not path.is_file():
        raise error(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as failure:
        raise error(f"{path}: not valid JSON ({failure.msg} at line {failure.lineno}): fix the file") from None


def load_cluster(spec: str) -> Cluster:
    """A preset name (``paper``, ``a100x8``, ``h100x8``) or a YAML/JSON file of :data:`CLUSTER_FIELDS`."""
    if spec in PRESETS:
        return cluster_from_mapping(PRESETS[spec], source=f"cluster preset {spec}")
    if spec == LOCAL:
        raise ClusterError("--cluster local is profiled from a config: pass the config too "
                           "(pipetransformer plan CONFIG --cluster local)")
    path = Path(spec)
    if not path.is_file():
        raise ClusterError(f"--cluster {spec}: neither a preset ({', '.join([*PRESETS, LOCAL])}) nor a file")
    text = path.read_text()
    try:
        fields = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ClusterError(f"{spec}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
                           f"({' '.join(str(error).split())[:120]}): fix the syntax") from None
    return cluster_from_mapping(fields, source=spec)
