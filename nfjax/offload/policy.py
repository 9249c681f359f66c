"""The offloading policy (FlexGen section 4): how a block of sequences is batched and where weights, KV cache and
activations live. A frozen dataclass that round-trips through JSON (`--offload POLICY.json`):

    {"gpu_batch_size": 8, "num_gpu_batches": 4,
     "weights": {"gpu": 20, "cpu": 80, "disk": 0},
     "cache": {"gpu": 0, "cpu": 100, "disk": 0},
     "activations": {"gpu": 100, "cpu": 0, "disk": 0},
     "compress_weights": true, "compress_cache": false, "cpu_attention": false, "attention_topk": 100,
     "gpu_memory_gb": 16, "cpu_memory_gb": 100, "disk_gb": 60, "offload_dir": "/scratch/nfjax"}

Percentages are of each layer's weights (by bytes, FlexGen's split), of the (layer, GPU batch) KV blocks and of
the GPU batches' activations; each triple adds up to 100. Every error names the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nfjax.errors import UserError

TIERS = ("gpu", "cpu", "disk")
HOST_MEMORY = ("pinned", "numpy")
SCHEDULES = ("zigzag", "row_by_row")


class PolicyError(UserError):
    """A policy that cannot run, naming the field at fault."""


@dataclass(frozen=True)
class Split:
    """Percentages of one kind of data on the GPU, in host memory and on disk."""
    gpu: float = 100.0
    cpu: float = 0.0
    disk: float = 0.0

    def check(self, name: str) -> None:
        for t in TIERS:
            v = getattr(self, t)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not 0 <= v <= 100:
                raise PolicyError(f"policy {name}.{t}: a percentage in [0, 100], got {v!r}")
        total = self.gpu + self.cpu + self.disk
        if abs(total - 100) > 1e-6:
            raise PolicyError(f"policy {name}: gpu + cpu + disk must add up to 100, got {self.gpu:g} + {self.cpu:g} + "
                              f"{self.disk:g} = {total:g}")

    def fractions(self) -> tuple[float, float, float]:
        return self.gpu / 100, self.cpu / 100, self.disk / 100


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 1            # sequences a layer computes at once
    num_gpu_batches: int = 1           # GPU batches in a block: a layer's weights are loaded once per block
    weights: Split = field(default_factory=Split)
    cache: Split = field(default_factory=Split)
    activations: Split = field(default_factory=Split)
    compress_weights: bool = False     # off-GPU weights stored, moved as 4-bit groups of 64 (nfjax/offload/compress.py)
    compress_cache: bool = False       # KV cache stored and moved as int4 groups of 64 (kv_quant.py), every tier
    cpu_attention: bool = False        # decode attention on the CPU for KV blocks held off the GPU (FlexGen 4.2)
    attention_topk: float = 100.0      # Top-K sparse attention: % of each query's scores kept (100: dense)
    host_memory: str = "pinned"        # host tier: "pinned" (JAX pinned_host arrays) | "numpy" (host arrays)
    schedule: str = "zigzag"           # "zigzag" (FlexGen Alg. 1) | "row_by_row" (the baseline: each batch in
    #                                    turn loads each layer's weights synchronously, nothing overlaps)
    gpu_memory_gb: float | None = None     # caps the plan must fit (None: the device's, host's, disk's free space)
    cpu_memory_gb: float | None = None
    disk_gb: float | None = None
    offload_dir: str | None = None     # where the disk tier's files go (None: $NFJAX_CACHE/offload)
    io_threads: int = 4                # threads that read and write the host and disk tiers

    def __post_init__(self):
        for f in ("gpu_batch_size", "num_gpu_batches", "io_threads"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PolicyError(f"policy {f}: an integer >= 1, got {v!r}")
        for f in ("weights", "cache", "activations"):
            getattr(self, f).check(f)
        for f in ("compress_weights", "compress_cache", "cpu_attention"):
            if not isinstance(getattr(self, f), bool):
                raise PolicyError(f"policy {f}: true or false, got {getattr(self, f)!r}")
        if self.host_memory not in HOST_MEMORY:
            raise PolicyError(f"policy host_memory: one of {', '.join(HOST_MEMORY)}, got {self.host_memory!r}")
        if self.schedule not in SCHEDULES:
            raise PolicyError(f"policy schedule: one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for f in ("gpu_memory_gb", "cpu_memory_gb", "disk_gb"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                raise PolicyError(f"policy {f}: a size in GB > 0 (or null for what the machine has), got {v!r}")
        v = self.attention_topk
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not 0 < v <= 100:
            raise PolicyError(f"policy attention_topk: a percentage in (0, 100] of each query's attention scores "
                              f"to keep, got {v!r}")

    @property
    def block_size(self) -> int:
        """Sequences a block holds: gpu_batch_size x num_gpu_batches."""
        return self.gpu_batch_size * self.num_gpu_batches

    def uses_disk(self) -> bool:
        return any(getattr(self, f).disk > 0 for f in ("weights", "cache", "activations"))

    def replace(self, **kw: Any) -> "Policy":
        return dataclasses.replace(self, **kw)

    # ---- JSON ---------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any, where: str = "policy") -> "Policy":
        if not isinstance(d, dict):
            raise PolicyError(f"{where}: expected a JSON object with fields {', '.join(_FIELDS)}")
        bad = sorted(set(d) - set(_FIELDS))
        if bad:
            raise PolicyError(f"{where}: unknown field {bad[0]!r}; fields are {', '.join(_FIELDS)}")
        kw = dict(d)
        for f in ("weights", "cache", "activations"):
            if f in kw:
                kw[f] = _split(kw[f], f)
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise PolicyError(f"--offload {p}: no such policy file") from None
        except json.JSONDecodeError as e:
            raise PolicyError(f"--offload {p}: not valid JSON ({e})") from None
        return cls.from_json(d, where=f"--offload {p}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))


_FIELDS = tuple(f.name for f in dataclasses.fields(Policy))


def _split(v: Any, name: str) -> Split:
    if isinstance(v, Split):
        return v
    if not isinstance(v, dict):
        raise PolicyError(f"policy {name}: an object {{\"gpu\": %, \"cpu\": %, \"disk\": %}}, got {v!r}")
    bad = sorted(set(v) - set(TIERS))
    if bad:
        raise PolicyError(f"policy {name}.{bad[0]}: unknown tier; tiers are {', '.join(TIERS)}")
    return Split(**{t: v.get(t, 0.0) for t in TIERS})
