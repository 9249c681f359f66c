"""NanoFlow plans: JSON files (one per model x GPU x TP x workload); fields in nfjax/plans/README.md.

A plan fixes, for a reference token bucket, the nano-batch sizes of each op group, the op order of each
stream and the resource share of each op. It applies to any bucket >= `min_bucket` by scaling the sizes in
proportion (boundaries on multiples of `align`). The MILP auto-search will write these files; the hand-tuned
winners ship in nfjax/plans/ (package data: they load by name from any install). Every error names the offending
field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nfjax.config import read_json
from nfjax.errors import UserError

FORMAT = 1
PLANS_DIR = Path(__file__).resolve().parents[1] / "plans"      # nfjax/plans, shipped in the wheel


class PlanError(UserError):
    """A plan file nfjax cannot run; the message names the field."""


@dataclass(frozen=True)
class OpGroup:
    name: str
    ops: tuple[str, ...]
    nano_batches: tuple[int, ...]      # token counts at the plan's bucket, in token order


@dataclass(frozen=True)
class StreamOrder:
    stream: int                        # 0, 1, ...: the orders are interleaved (NanoFlow's streams)
    order: tuple[str, ...]             # "GROUP:K" (all the group's ops) or "OP:K"; K = the group's nano-batch

    def entries(self) -> list[list[tuple[str, int]]]:
        """Each order entry as its (name, K) parts: one, or several for "OP:K+OP:K" (a horizontal kernel)."""
        return [[_entry(x, f"stream {self.stream}") for x in e.split("+")] for e in self.order]


@dataclass(frozen=True)
class Plan:
    name: str
    bucket: int
    groups: tuple[OpGroup, ...]
    streams: tuple[StreamOrder, ...]
    share: dict[str, float] = field(default_factory=dict)
    min_bucket: int = 0
    max_bucket: int = 0                # 0: no upper bound; else compiled only for buckets <= this
    min_decode: int = 0                # the batch class: chosen for batches with at least this many decodes
    align: int = 8
    model: str = ""
    device: str = ""
    tp: int = 1
    source: str = ""
    description: str = ""
    # Leave XLA's dot merger on for this plan (it is off for split variants, so that it does not fuse their
    # nano-batch GEMMs back together). Meant for plans whose split GEMMs cannot merge anyway (one runs before a
    # fused kernel, the other after it), so that q/k/v become one GEMM again; on `_mact` it measured no gain
    # (docs/design.md section 5).
    xla_dot_merger: bool = False

    # ---- lookup -----------------------------------------------------------------------------------------
    def has_group(self, name: str) -> bool:
        return any(g.name == name for g in self.groups)

    def group(self, name: str) -> OpGroup:
        return next(g for g in self.groups if g.name == name)

    def _place(self, name: str, k: int, w: str, stream: int, graph, seen: dict, placed: dict) -> None:
        if self.has_group(name):
            g, ops = self.group(name), self.group(name).ops
        elif name in graph:
            g, ops = self.group(seen[name]), (name,)
        else:
            raise PlanError(f"{w}: {name!r} is neither a group nor an op")
        if k >= len(g.nano_batches):
            raise PlanError(f"{w}: group {g.name!r} has {len(g.nano_batches)} nano-batches, no {k}")
        from nfjax.schedule.graph import MAIN_STREAM_ONLY
        for op in ops:
            if stream and graph[op].main_stream_only:
                raise PlanError(f"{w}: {op!r} must be on stream 0 ({MAIN_STREAM_ONLY})")
            if (op, k) in placed:
                raise PlanError(f"{w}: {op}:{k} is already ordered at {placed[(op, k)]}")
            placed[(op, k)] = w

    @staticmethod
    def _check_horizontal(e: str, w: str, stream: int, graph) -> None:
        from nfjax.schedule.beside import HORIZONTAL_KERNELS
        names = frozenset(_entry(x, w)[0] for x in e.split("+"))
        if names not in HORIZONTAL_KERNELS:
            known = ", ".join("+".join(sorted(k)) for k in HORIZONTAL_KERNELS)
            raise PlanError(f"{w}: no horizontal kernel runs {' + '.join(sorted(names))} side by side "
                            f"(known: {known})")
        if stream:
            raise PlanError(f"{w}: a horizontal kernel shares out the SMs itself: put it on stream 0")

    def share_of(self, op: str, k: int) -> float | None:
        """Resource share of `op` on its group's nano-batch k: the "OP:K" entry, else the "OP" one."""
        return self.share.get(f"{op}:{k}", self.share.get(op))

    def scaled_sizes(self, g: OpGroup, num_tokens: int) -> list[int] | None:
        from nfjax.schedule.strategies import split_sizes
        return split_sizes(g.nano_batches, num_tokens, self.align)

    # ---- JSON -------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "name": self.name, "description": self.description, "source": self.source,
                "model": self.model, "device": self.device, "tp": self.tp, "bucket": self.bucket,
                "min_bucket": self.min_bucket, "max_bucket": self.max_bucket, "min_decode": self.min_decode,
                "align": self.align,
                "groups": [{"name": g.name, "ops": list(g.ops), "nano_batches": list(g.nano_batches)}
                           for g in self.groups],
                "streams": [{"stream": s.stream, "order": list(s.order)} for s in self.streams],
                "share": dict(self.share), "xla_dot_merger": self.xla_dot_merger}

    @classmethod
    def from_json(cls, d, where: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected a JSON object, got {type(d).__name__}")
        known = {"format", "name", "description", "source", "model", "device", "tp", "bucket", "min_bucket",
                 "max_bucket", "min_decode", "align", "groups", "streams", "share", "xla_dot_merger"}
        extra = sorted(set(d) - known)
        if extra:
            raise PlanError(f"{where}: unknown field {extra[0]!r}")
        if d.get("format", FORMAT) != FORMAT:
            raise PlanError(f"{where}.format: this nfjax reads format {FORMAT}, got {d['format']!r}")
        req = lambda k: _get(d, k, where)                                         # noqa: E731
        groups = []
        for i, g in enumerate(_list(req("groups"), f"{where}.groups")):
            w = f"{where}.groups[{i}]"
            if not isinstance(g, dict):
                raise PlanError(f"{w}: expected an object")
            groups.append(OpGroup(_str(_get(g, "name", w), f"{w}.name"),
                                  tuple(_str(o, f"{w}.ops[{j}]") for j, o in enumerate(_list(_get(g, "ops", w),
                                                                                              f"{w}.ops"))),
                                  tuple(_int(n, f"{w}.nano_batches[{j}]", 1) for j, n in
                                        enumerate(_list(_get(g, "nano_batches", w), f"{w}.nano_batches")))))
        streams = []
        for i, s in enumerate(_list(req("streams"), f"{where}.streams")):
            w = f"{where}.streams[{i}]"
            if not isinstance(s, dict):
                raise PlanError(f"{w}: expected an object")
            streams.append(StreamOrder(_int(_get(s, "stream", w), f"{w}.stream", 0),
                                       tuple(_str(e, f"{w}.order[{j}]") for j, e in
                                             enumerate(_list(_get(s, "order", w), f"{w}.order")))))
        share = d.get("share", {})
        if not isinstance(share, dict):
            raise PlanError(f"{where}.share: expected an object mapping op names to fractions")
        for k, v in share.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise PlanError(f"{where}.share.{k}: must be a number in (0, 1], got {v!r}")
        merger = d.get("xla_dot_merger", False)
        if not isinstance(merger, bool):
            raise PlanError(f"{where}.xla_dot_merger: must be true or false, got {merger!r}")
        return cls(name=_str(req("name"), f"{where}.name"), bucket=_int(req("bucket"), f"{where}.bucket", 1),
                   groups=tuple(groups), streams=tuple(streams), share={k: float(v) for k, v in share.items()},
                   min_bucket=_int(d.get("min_bucket", 0), f"{where}.min_bucket", 0),
                   max_bucket=_int(d.get("max_bucket", 0), f"{where}.max_bucket", 0),
                   min_decode=_int(d.get("min_decode", 0), f"{where}.min_decode", 0),
                   align=_int(d.get("align", 8), f"{where}.align", 1), model=str(d.get("model", "")),
                   device=str(d.get("device", "")), tp=_int(d.get("tp", 1), f"{where}.tp", 1),
                   source=str(d.get("source", "")), description=str(d.get("description", "")),
                   xla_dot_merger=merger)

    # ---- meaning ------------------------------------------------------------------------------------------
    def validate(self, graph, where: str = "plan") -> "Plan":
        """Check the plan against the layer's op graph (structure only; deadlocks show when it is planned)."""
        seen: dict[str, str] = {}
        names = set()
        for i, g in enumerate(self.groups):
            w = f"{where}.groups[{i}]"
            if g.name in names or g.name in graph:
                raise PlanError(f"{w}.name: {g.name!r} is already a group or op name")
            names.add(g.name)
            if not g.ops:
                raise PlanError(f"{w}.ops: a group needs at least one op")
            for j, op in enumerate(g.ops):
                if op not in graph:
                    raise PlanError(f"{w}.ops[{j}]: unknown op {op!r}; the layer's ops are "
                                    f"{', '.join(graph.names)}")
                if op in seen:
                    raise PlanError(f"{w}.ops[{j}]: op {op!r} is already in group {seen[op]!r}")
                seen[op] = g.name
            if not g.nano_batches:
                raise PlanError(f"{w}.nano_batches: a group needs at least one nano-batch")
            if sum(g.nano_batches) != self.bucket:
                raise PlanError(f"{w}.nano_batches: sizes must sum to bucket={self.bucket}, got "
                                f"{sum(g.nano_batches)}")
        lost = [op for op in graph.names if op not in seen]
        if lost:
            raise PlanError(f"{where}.groups: op {lost[0]!r} is in no group")
        if not self.streams:
            raise PlanError(f"{where}.streams: at least one stream order is needed")
        ids = [s.stream for s in self.streams]
        if len(set(ids)) != len(ids):
            raise PlanError(f"{where}.streams: stream ids must be distinct, got {ids}")
        placed: dict[tuple[str, int], str] = {}
        for i, s in enumerate(self.streams):
            for j, e in enumerate(s.order):
                w = f"{where}.streams[{i}].order[{j}]"
                if "+" in e:
                    self._check_horizontal(e, w, s.stream, graph)
                for name, k in (_entry(x, w) for x in e.split("+")):
                    self._place(name, k, w, s.stream, graph, seen, placed)
        for g in self.groups:
            for op in g.ops:
                for k in range(len(g.nano_batches)):
                    if (op, k) not in placed:
                        raise PlanError(f"{where}.streams: {op}:{k} (group {g.name!r}) is in no stream order")
        group_of = {op: g for g in self.groups for op in g.ops}
        for key in self.share:
            op, sep, k = key.rpartition(":")
            op = op if sep else key
            if op not in graph:
                raise PlanError(f"{where}.share.{key}: unknown op {op!r}")
            if sep and (not k.isdigit() or int(k) >= len(group_of[op].nano_batches)):
                raise PlanError(f"{where}.share.{key}: {k!r} is not a nano-batch index of group "
                                f"{group_of[op].name!r} ({len(group_of[op].nano_batches)} nano-batches)")
        return self


def _entry(e: str, where: str) -> tuple[str, int]:
    name, sep, k = e.rpartition(":")
    if not sep or not name or not k.isdigit():
        raise PlanError(f"{where}: expected 'GROUP:K' or 'OP:K' (K a nano-batch index), got {e!r}")
    return name, int(k)


def _get(d: dict, k: str, where: str):
    if k not in d:
        raise PlanError(f"{where}: missing field {k!r}")
    return d[k]


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise PlanError(f"{where}: expected a list, got {type(v).__name__}")
    return v


def _str(v, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise PlanError(f"{where}: expected a non-empty string, got {v!r}")
    return v


def _int(v, where: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise PlanError(f"{where}: expected an integer >= {lo}, got {v!r}")
    return v


def plan_path(name_or_path: str | Path) -> Path:
    """A plan file: a path, or the name of a shipped plan (nfjax/plans/, with or without .json)."""
    if str(name_or_path) == "auto":
        raise PlanError("plan 'auto' is resolved when the engine is built (nfjax.engine.builder.engine_config "
                        "knows the model, device and TP degree); load_plan takes a plan name or file")
    p = Path(name_or_path)
    if p.is_file():
        return p
    for cand in (PLANS_DIR / p.name, PLANS_DIR / f"{p.name}.json"):
        if cand.exists():
            return cand
    raise PlanError(f"plan {str(name_or_path)!r}: no such file (looked in {PLANS_DIR})")


def load_plan(name_or_path: str | Path, graph=None) -> Plan:
    p = plan_path(name_or_path)
    plan = Plan.from_json(read_json(p, PlanError), where=p.name)
    if graph is None:
        from nfjax.schedule.graph import layer_graph
        graph = layer_graph()
    return plan.validate(graph, where=p.name)


def save_plan(plan: Plan, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    return p
