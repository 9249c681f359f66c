"""What the kernels need from the jax version and the device, kept beside them: pallas_kernels/ imports nothing
from nfjax. jax 0.10.2 (CPU dev/CI) and 0.11.2 (GPU machines) differ here in one place, `InterpretGPUParams`;
`nfjax.compat` re-exports both helpers with the engine's own version shims.
"""
from __future__ import annotations

import jax


def mosaic_gpu_interpret_params(**kw):
    """`InterpretGPUParams` for running Pallas Mosaic GPU kernels on CPU (interpret mode).

    0.11 exports it as `jax.experimental.pallas.mosaic_gpu.InterpretGPUParams`; 0.10.2 has the same class
    only under `jax._src` (interpret mode itself works there).
    """
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(**kw)


# Known gap: the 0.10.2 GPU interpreter cannot run wgmma on a transposed shared-memory operand (q @ k.T) nor
# with the left operand in registers (p @ v), and has no CPU rule for layout casts. Kernels therefore use
# plain jnp matmuls on loaded SMEM tiles and no layout hints when interpreting (pallas_kernels/_mgpu.py).


def num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the first GPU (the natural CTA count of a persistent kernel)."""
    try:
        d = jax.devices()[0]
        n = getattr(d, "core_count", None)
        return int(n) if n else default
    except Exception:   # noqa: BLE001 - no device / attribute: fall back
        return default
