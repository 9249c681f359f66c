"""Step variants: which strategies compile for which bucket, and the per-batch choice among them at run time."""
from __future__ import annotations

from dataclasses import dataclass

from nfjax.compat import NO_DOT_MERGER
from nfjax.config import ExecutionConfig, StrategyConfig
from nfjax.schedule.api import LayerSchedule, ScheduleContext, Strategy
from nfjax.schedule.executor import schedule_layer_fn
from nfjax.schedule.graph import layer_graph
from nfjax.schedule.strategies import STRATEGIES

SEQUENTIAL = "sequential"


def build_strategy(sc: StrategyConfig, graph=None) -> Strategy:
    """The strategy of `sc`; a NanoFlow plan is validated against `graph` (default: the dense layer's)."""
    if sc.kind == "nanoflow" and graph is not None:
        from nfjax.schedule.plan import load_plan
        return STRATEGIES[sc.kind](load_plan(sc.plan), name=sc.label, graph=graph)
    return STRATEGIES[sc.kind].from_config(sc)


@dataclass(frozen=True)
class Variant:
    label: str
    config: StrategyConfig
    layer_schedule: LayerSchedule
    splits: bool
    dot_merger: bool = False

    def layer_fn(self):
        return schedule_layer_fn(self.layer_schedule)

    def compiler_options(self) -> dict:
        """The dot merger off for split variants (unless their plan keeps it)."""
        return dict(NO_DOT_MERGER) if self.splits and not self.dot_merger else {}


class Variants:
    """The variants of every bucket (recorded now; compiled by the runner) and the per-batch choice."""

    def __init__(self, cfg: ExecutionConfig, buckets, tp: int, graph=None, sequential_only=()):
        """`graph`: the model's layer graph (default: the dense Llama layer's; `layer_graph(model_cfg)`).
        `sequential_only`: further buckets that get the Sequential variant alone (the batcher's prefill bucket)."""
        self.cfg = cfg
        graph = graph or layer_graph()
        confs = list(cfg.strategies)
        if SEQUENTIAL not in [c.label for c in confs]:
            confs.append(StrategyConfig())                      # the fallback, compiled for every bucket
        self.order = [c.label for c in confs]
        self.by_bucket: dict[int, dict[str, Variant]] = {}
        self.skipped: dict[tuple[int, str], str] = {}           # (bucket, label) -> why it does not compile
        for b in sorted(buckets):
            ctx = ScheduleContext(b, graph, tp)
            vs = {}
            for c in confs:
                if b < c.min_bucket:
                    self.skipped[(b, c.label)] = f"bucket < min_bucket={c.min_bucket}"
                    continue
                s = build_strategy(c, graph)
                why = s.eligible(ctx)
                if why:
                    self.skipped[(b, c.label)] = why
                    continue
                vs[c.label] = Variant(c.label, c, s.record(ctx), s.splits, s.dot_merger)
            self.by_bucket[b] = vs
        seq = next(c for c in confs if c.label == SEQUENTIAL)
        for b in sequential_only:
            s = build_strategy(seq, graph)
            self.by_bucket[b] = {SEQUENTIAL: Variant(SEQUENTIAL, seq, s.record(ScheduleContext(b, graph, tp)),
                                                     s.splits, s.dot_merger)}

    def choose(self, bucket: int, num_tokens: int, num_decode: int, pinned: str | None = None) -> str:
        vs = self.by_bucket[bucket]
        if pinned is not None:
            return pinned if pinned in vs else SEQUENTIAL
        for label in self.order:
            v = vs.get(label)
            if v and num_tokens >= v.config.min_tokens and num_decode >= v.config.min_decode:
                return label
        return SEQUENTIAL
