"""Nano-batch schedules: the layer's op graph, the scheduling API, strategies, NanoFlow plans, the executor.

A strategy (`Strategy` subclass) is recorded per token bucket into a `LayerSchedule` (pure Python, validated), which
the executor traces into the layer-group programs: every nano-op of a layer group lives in one compiled program.
"""
from nfjax.schedule.api import (Kernel, NanoBatch, NanoOp, LayerSchedule, ScheduleContext, ScheduleError, Strategy,
                                Step)
from nfjax.schedule.graph import OpGraph, layer_graph
from nfjax.schedule.plan import Plan, PlanError, load_plan, save_plan
from nfjax.schedule.strategies import (REDUCE_NORM, CommOverlap, DualBatchOverlap, FusedReduceNorm,
                                       NanoBatchOnly, NanoFlow, Sequential)

__all__ = ["Kernel", "NanoBatch", "NanoOp", "LayerSchedule", "ScheduleContext", "ScheduleError", "Strategy", "Step",
           "OpGraph", "layer_graph", "Plan", "PlanError", "load_plan", "save_plan", "REDUCE_NORM", "CommOverlap",
           "DualBatchOverlap", "FusedReduceNorm", "NanoBatchOnly", "NanoFlow", "Sequential"]
