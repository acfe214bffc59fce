"""One training step of one pipeline replica as a timeline of events.

Every stage runs its forward and backward of each micro-batch in the order its schedule gives (GPipe:
all forwards, then all backwards; 1F1B: ``K - s - 1`` warm-up forwards, then one forward and one
backward in turn); an operation starts when its stage is free and its input has arrived. Activations
and gradients cross each stage boundary over that boundary's link, one message after another in each
direction, without stalling the sender. After its last backward each stage sums its trainable gradients
over its data-parallel group in buckets (ring all-reduce), a bucket as soon as its blocks' gradients
are final when ``overlap`` is on (what DDP does, in the last micro-batch's backward), else after that
backward; buckets of groups that cross nodes share the nodes' network interface, one at a time. Then
the optimizer step. Replicas are identical, so one replica's timeline is the step.

The bubble fraction and the activations each stage holds are read off the timeline, not from a formula
(:func:`pipetransformer.pipe.partition.bubble_fraction` is what the tests compare against).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipetransformer.pipe.cost import (
    ADAMW_STATE_FACTOR,
    FLOAT_BYTES,
    BlockCost,
    BlockState,
    Link,
    as_trained,
    block_forward_seconds,
    block_memory,
    transfer_time,
    validate_states,
)

__all__ = [
    "Event",
    "StageWork",
    "StepSimulation",
    "SyncGroup",
    "allreduce_time",
    "op_order",
    "optimizer_step_bytes",
    "simulate_step",
    "stage_works",
]

SCHEDULES = ("gpipe", "1f1b")

FORWARD, BACKWARD = "forward", "backward"
ACTIVATION, GRADIENT, CACHE_READ = "activation", "gradient", "cache read"
ALLREDUCE, OPTIMIZER = "all-reduce", "optimizer"
COMPUTE_KINDS = (FORWARD, BACKWARD)

OPTIMIZER_PASSES_BASE = 3
"""An optimizer step reads each parameter and its gradient and writes the parameter (3 passes), and reads
and writes each state tensor (2 passes per tensor); all fp32 and memory-bound."""

def optimizer_step_bytes(params: int, optimizer_state_factor: int) -> int:
    """Bytes one optimizer step moves through memory for ``params`` fp32 parameters."""
    return params * FLOAT_BYTES * (OPTIMIZER_PASSES_BASE + 2 * optimizer_state_factor)


_GLYPHS = {FORWARD: "F", BACKWARD: "B", ALLREDUCE: "A", OPTIMIZER: "O"}
IDLE_GLYPH = "."


@dataclass(frozen=True)
class StageWork:
    """What one stage does for one micro-batch, what it synchronises once per step, and its memory.

    ``gradient_buckets`` are (bytes, share of the last backward done when the bucket is ready), last
    blocks first, as :class:`pipetransformer.dp.sync.GradientSync` fills them. A stage that trains
    nothing has ``backward_s == 0`` and runs forwards only.
    """

    forward_s: float
    backward_s: float
    activation_out_bytes: int
    gradient_out_bytes: int
    gradient_buckets: tuple[tuple[int, float], ...]
    optimizer_s: float
    fixed_memory_bytes: int
    activation_bytes_per_micro_batch: int
    transient_bytes: int
    cache_in_bytes: int = 0

    @property
    def trains(self) -> bool:
        return self.backward_s > 0


@dataclass(frozen=True)
class SyncGroup:
    """A stage's data-parallel group: ``size`` replicas joined by ``link``; groups with the same
    ``resource`` (a shared network interface) run their buckets one at a time."""

    size: int
    link: Link
    resource: str


@dataclass(frozen=True)
class Event:
    kind: str
    stage: int
    micro_batch: int | None
    start: float
    end: float
    resource: str


@dataclass(frozen=True)
class StepSimulation:
    """The timeline of one step and what is read off it."""

    events: list[Event]
    step_s: float
    bubble_fraction: float
    peak_in_flight: list[int]
    stage_memory_bytes: list[int]
    sync_exposed_s: float  # time from the last computation to the end of the step (all-reduce + optimizer)

    def render(self, width: int = 100) -> str:
        """One row per stage (F forward, B backward, . idle) and one per stage's gradient sync (A, then O)."""
        if self.step_s <= 0:
            return ""
        stages = 1 + max(event.stage for event in self.events)
        rows = []
        for stage in range(stages):
            for label, kinds in ((f"stage {stage}", COMPUTE_KINDS), (f"sync  {stage}", (ALLREDUCE, OPTIMIZER))):
                mine = [e for e in self.events if e.stage == stage and e.kind in kinds and e.end > e.start]
                if not mine and kinds != COMPUTE_KINDS:
                    continue
                cells = []
                for column in range(width):
                    t = (column + 0.5) * self.step_s / width
                    hit = next((e for e in mine if e.start <= t < e.end), None)
                    cells.append(_GLYPHS[hit.kind] if hit else IDLE_GLYPH)
                rows.append(f"{label:<8} |{''.join(cells)}|")
        return "\n".join(rows)


def allreduce_time(num_bytes: float, group_size: int, link: Link) -> float:
    """Ring all-reduce: each member sends and receives 2 (n - 1) / n of the data in 2 (n - 1) messages."""
    if group_size <= 1:
        return 0.0
    steps = 2 * (group_size - 1)
    return steps / group_size * num_bytes / link.bandwidth_bytes_per_s + steps * link.latency_s


def op_order(schedule: str, num_stages: int, num_micro_batches: int, stage: int, trains: bool) -> list[tuple[str, int]]:
    """The (kind, micro-batch) operations stage ``stage`` runs in one step, in order."""
    forwards = [(FORWARD, m) for m in range(num_micro_batches)]
    if not trains:
        return forwards
    if schedule == "gpipe":
        return forwards + [(BACKWARD, m) for m in range(num_micro_batches)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    warmup = min(num_stages - stage - 1, num_micro_batches)
    order = forwards[:warmup]
    for m in range(num_micro_batches - warmup):
        order += [(FORWARD, warmup + m), (BACKWARD, m)]
    return order + [(BACKWARD, m) for m in range(num_micro_batches - warmup, num_micro_batches)]


def _peak_in_flight(order: list[tuple[str, int]]) -> int:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not yet)."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak


class _Channel:
    """A link used by one message at a time, in the order messages are handed to it."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.free_at = 0.0

    def send(self, ready: float, num_bytes: float) -> tuple[float, float]:
        start = max(ready, self.free_at)
        self.free_at = start + transfer_time(num_bytes, self.link)
        return start, self.free_at


def simulate_step(
    stages: Sequence[StageWork],
    *,
    num_micro_batches: int,
    schedule: str,
    links: Sequence[Link],
    sync: Sequence[SyncGroup | None] | None = None,
    overlap: bool = True,
    cache_link: Link | None = None,
) -> StepSimulation:
    """The timeline of one step; ``links[s]`` joins stage ``s`` and ``s + 1``, ``sync[s]`` is stage
    ``s``'s data-parallel group (None or size 1: nothing to all-reduce), ``cache_link`` carries the
    cached prefix's output to stage 0 (host memory to device)."""
    num_stages = len(stages)
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {num_stages} and {num_micro_batches}")
    if len(links) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} links between them, got {len(links)}")
    if any(stages[s].trains and not stages[s + 1].trains for s in range(num_stages - 1)):
        raise ValueError("a stage that trains must not precede one that does not: frozen blocks are a prefix")
    orders = [op_order(schedule, num_stages, num_micro_batches, s, stages[s].trains) for s in range(num_stages)]
    forward_links = [_Channel(link) for link in links]
    backward_links = [_Channel(link) for link in links]
    arrivals: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> input ready
    events: list[Event] = []
    if stages[0].cache_in_bytes:
        channel = _Channel(cache_link or Link(math.inf))
        for m in range(num_micro_batches):
            start, end = channel.send(0.0, stages[0].cache_in_bytes)
            events.append(Event(CACHE_READ, 0, m, start, end, "host->stage 0"))
            arrivals[(FORWARD, 0, m)] = end
    free = [0.0] * num_stages
    position = [0] * num_stages
    last_backward: dict[int, Event] = {}
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                needs_input = (kind == FORWARD and (s > 0 or stages[0].cache_in_bytes)) or (
                    kind == BACKWARD and s < num_stages - 1)
                if needs_input and (kind, s, m) not in arrivals:
                    break
                start = max(free[s], arrivals.get((kind, s, m), 0.0))
                end = start + (stages[s].forward_s if kind == FORWARD else stages[s].backward_s)
                event = Event(kind, s, m, start, end, f"stage {s}")
                events.append(event)
                free[s] = end
                position[s] += 1
                remaining -= 1
                progressed = True
                if kind == FORWARD and s < num_stages - 1:
                    t0, t1 = forward_links[s].send(end, stages[s].activation_out_bytes)
                    events.append(Event(ACTIVATION, s, m, t0, t1, f"link {s}->{s + 1}"))
                    arrivals[(FORWARD, s + 1, m)] = t1
                if kind == BACKWARD:
                    last_backward[s] = event
                    if s > 0 and stages[s - 1].trains:
                        t0, t1 = backward_links[s - 1].send(end, stages[s].gradient_out_bytes)
                        events.append(Event(GRADIENT, s, m, t0, t1, f"link {s}->{s - 1}"))
                        arrivals[(BACKWARD, s - 1, m)] = t1
        if not progressed:
            raise RuntimeError(f"the {schedule} schedule deadlocked: an operation waits for input never sent")
    events += _synchronise(stages, last_backward, sync, overlap)
    return _summarise(stages, orders, events)


def _synchronise(stages: Sequence[StageWork], last_backward: dict[int, Event],
                 sync: Sequence[SyncGroup | None] | None, overlap: bool) -> list[Event]:
    """Bucketed all-reduce per stage, in order of readiness on each shared resource; then the optimizer."""
    pending = []
    for s, final in last_backward.items():
        group = sync[s] if sync is not None else None
        if group is None or group.size <= 1:
            continue
        for num_bytes, share in stages[s].gradient_buckets:
            ready = final.start + share * (final.end - final.start) if overlap else final.end
            pending.append((ready, s, num_bytes, group))
    channels: dict[str, float] = {}
    done = {s: final.end for s, final in last_backward.items()}
    events = []
    for ready, s, num_bytes, group in sorted(pending, key=lambda item: (item[0], item[1])):
        start = max(ready, channels.get(group.resource, 0.0))
        end = start + allreduce_time(num_bytes, group.size, group.link)
        channels[group.resource] = end
        done[s] = max(done[s], end)
        events.append(Event(ALLREDUCE, s, None, start, end, group.resource))
    for s, start in done.items():
        events.append(Event(OPTIMIZER, s, None, start, start + stages[s].optimizer_s, f"stage {s}"))
    return events


def _summarise(stages: Sequence[StageWork], orders: list[list[tuple[str, int]]], events: list[Event]) -> StepSimulation:
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    first, last = min(e.start for e in compute), max(e.end for e in compute)
    busy = sum(e.end - e.start for e in compute)
    span = last - first
    bubble = 1.0 - busy / (len(stages) * span) if span > 0 else 0.0
    peaks = [_peak_in_flight(order) if stage.trains else 0 for stage, order in zip(stages, orders, strict=True)]
    memory = [stage.fixed_memory_bytes + stage.activation_bytes_per_micro_batch * peak + stage.transient_bytes
              for stage, peak in zip(stages, peaks, strict=True)]
    step = max(e.end for e in events)
    return StepSimulation(events=sorted(events, key=lambda e: (e.start, e.stage)), step_s=step,
                          bubble_fraction=bubble, peak_in_flight=peaks, stage_memory_bytes=memory,
                          sync_exposed_s=step - last)


def stage_works(
    costs: Sequence[BlockCost],
    states: Sequence[BlockState],
    bounds: Sequence[tuple[int, int]],
    *,
    micro_batch_size: int,
    overhead_s: float,
    memory_bytes_per_s: float,
    bucket_bytes: int,
    optimizer_state_factor: int = ADAMW_STATE_FACTOR,
    touched_rows_samples: int | None = None,
) -> list[StageWork]:
    """Each stage's work for micro-batches of ``micro_batch_size`` from per-sample (and per-call) block costs.

    A frozen block runs its frozen forward only (:attr:`BlockCost.frozen_forward`), a cached one not at all (its
    output is read from the cache into stage 0), the lowest active one its backward without its input's gradient
    (:func:`~pipetransformer.pipe.cost.as_trained`); ``overhead_s`` is added to every forward and backward a stage runs.
    With ``touched_rows_samples`` (the step's samples over every replica) vocabulary tables are summed by touched
    rows after the last backward, as :class:`pipetransformer.dp.sync.GradientSync` does with
    ``dp.touched_rows_only``; without it, whole in buckets.
    """
    validate_states(costs, states)
    costs = as_trained(costs, states)
    active = BlockState.ACTIVE
    works = []
    for start, end in bounds:
        blocks = range(start, end)
        trains = states[end - 1] is active
        run = [i for i in blocks if states[i] is not BlockState.CACHED]
        buckets: list[tuple[int, float]] = []
        total_backward = sum(costs[i].backward_s for i in blocks if states[i] is active)
        done, size, touched_rows = 0.0, 0, 0
        for i in reversed(blocks):
            if states[i] is not active:
                break
            done += costs[i].backward_s
            bucketed, rows = costs[i].allreduce_bytes(touched_rows_samples)
            size += bucketed
            touched_rows += rows
            if size and (size >= bucket_bytes or i == start or states[i - 1] is not active):
                buckets.append((size, done / total_backward if total_backward > 0 else 1.0))
                size = 0
        if touched_rows:
            buckets.append((touched_rows, 1.0))
        trainable_params = sum(costs[i].param_bytes for i in blocks if states[i] is active) // FLOAT_BYTES
        optimizer_bytes = optimizer_step_bytes(trainable_params, optimizer_state_factor)
        weights = sum(block_memory(costs[i], states[i], micro_batch_size=0,
                                   optimizer_state_factor=optimizer_state_factor) for i in blocks)
        activations = sum(costs[i].activation_bytes for i in blocks if states[i] is active) * micro_batch_size
        rebuilt = max((costs[i].recompute_bytes for i in blocks if states[i] is active), default=0)
        gradient_out = start > 0 and states[start - 1] is active
        works.append(StageWork(
            forward_s=sum(block_forward_seconds(costs[i], states[i], micro_batch_size) for i in run) + overhead_s,
            backward_s=(sum(costs[i].seconds(micro_batch_size)[1] for i in blocks if states[i] is active)
                        + overhead_s) if trains else 0.0,
            activation_out_bytes=costs[end - 1].output_bytes * micro_batch_size if end < len(costs) else 0,
            gradient_out_bytes=costs[start - 1].output_bytes * micro_batch_size if gradient_out else 0,
            gradient_buckets=tuple(buckets),
            optimizer_s=optimizer_bytes / memory_bytes_per_s,
            fixed_memory_bytes=weights,
            activation_bytes_per_micro_batch=activations,
            transient_bytes=rebuilt * micro_batch_size,
            cache_in_bytes=costs[start - 1].output_bytes * micro_batch_size
            if start > 0 and states[start - 1] is BlockState.CACHED else 0,
        ))
    return works
