"""numba kernels of the host Adam/AdamW: one streaming pass per tensor, parallel over chunks.

Per element the update reads the fp32 master weight, the two moments and the fp32 gradient
(16 bytes) and writes the master and the moments (12 bytes) - 28 bytes, the bandwidth bound - and,
in the same pass, the low-precision copy for the device (2 bytes for bf16). Chunks are contiguous
and independent, so results do not depend on the thread count.

The arithmetic follows ``torch.optim.AdamW``/``Adam`` (single-tensor path) operation by operation:
``m = lerp(m, g, 1 - beta1)``; ``v = beta2 v + (1 - beta2) g^2``;
``w -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)``; AdamW decays ``w *= 1 - lr wd`` first,
Adam adds ``wd w`` to the gradient.
"""

import numpy as np
from numba import njit, prange

COPY_NONE, COPY_BF16, COPY_F32 = 0, 1, 2


@njit(cache=True, nogil=True, inline="always")
def _bf16_bits(bits):
    """Round fp32 bits to bf16 bits, nearest-even; NaN stays a (quiet) NaN."""
    if (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (bits & np.uint32(0x007FFFFF)) != 0:
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16((bits + rounding) >> np.uint32(16))


@njit(cache=True, nogil=True, parallel=True)
def adam_step(w, m, v, g, out_bf16, out_f32, copy_mode, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2,
              step_size, bias_correction2_sqrt, eps, grad_scale, nchunks):
    """Update 1-D fp32 ``w``, ``m``, ``v`` in place from ``g * grad_scale``; optionally write the
    device copy (``out_bf16`` as uint16 bits, or ``out_f32``).

    The scalars arrive precomputed in double precision and rounded once, as torch does:
    ``decay`` is ``1 - lr * weight_decay`` (AdamW) or ``weight_decay`` (Adam), ``step_size`` is
    ``lr / (1 - beta1^t)``.
    """
    n = w.shape[0]
    bits = w.view(np.uint32)
    chunk = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            gi = g[i] * grad_scale
            wi = w[i]
            if decoupled:
                wi = wi * decay
            else:
                gi = gi + decay * wi
            mi = m[i] + one_minus_beta1 * (gi - m[i])
            vi = v[i] * beta2 + one_minus_beta2 * (gi * gi)
            m[i] = mi
            v[i] = vi
            w[i] = wi - step_size * (mi / (np.sqrt(vi) / bias_correction2_sqrt + eps))
            if copy_mode == 1:
                out_bf16[i] = _bf16_bits(bits[i])
            elif copy_mode == 2:
                out_f32[i] = w[i]


@njit(cache=True, nogil=True, parallel=True)
def sum_of_squares(g, nchunks):
    """``sum(g * g)`` in float64 (for the global gradient norm), and whether all of ``g`` is finite."""
    n = g.shape[0]
    chunk = (n + nchunks - 1) // nchunks
    partial = np.zeros(nchunks, np.float64)
    finite = np.ones(nchunks, np.bool_)
    for c in prange(nchunks):
        acc = 0.0
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            x = np.float64(g[i])
            acc += x * x
            if not np.isfinite(x):
                finite[c] = False
        partial[c] = acc
    return partial.sum(), finite.all()
