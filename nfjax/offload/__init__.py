"""FlexGen mode: models larger than the GPU, with weights, KV cache and activations placed across GPU, host
memory and disk by a `Policy`, and the zig-zag block schedule overlapping every transfer with compute
(docs/design.md, "FlexGen mode")."""
from nfjax.offload.policy import Policy, PolicyError, Split

__all__ = ["Policy", "PolicyError", "Split", "OffloadEngine"]


def __getattr__(name):
    if name == "OffloadEngine":
        from nfjax.offload.engine import OffloadEngine
        return OffloadEngine
    raise AttributeError(name)
