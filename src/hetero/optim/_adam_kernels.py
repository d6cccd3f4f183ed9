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

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

COPY_NONE, COPY_BF16, COPY_F32 = 0, 1, 2
# Value-safe fast-math only: FMA contraction and reciprocal/function approximations that LLVM
# needs to vectorize; no nnan/ninf, which would let it delete the NaN handling below.
FAST = {"contract", "arcp", "afn"}


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of a float32, as uint32 (a register bitcast: no memory round trip)."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(cache=True, nogil=True, inline="always", fastmath=FAST)
def _bf16(x):
    """Round float32 to bf16 bits, nearest-even, branch-free; NaN stays a (quiet) NaN."""
    b = _f32_bits(x)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(((b >> np.uint32(16)) | np.uint32(0x40)) if nan else rounded)


@njit(cache=True, nogil=True, inline="always", fastmath=FAST)
def _adam(w, m, v, g, i, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, grad_scale):
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
    wi = wi - step_size * (mi / (np.sqrt(vi) / bc2_sqrt + eps))
    w[i] = wi
    return wi


@njit(cache=True, nogil=True, parallel=True, fastmath=FAST)
def adam_step(w, m, v, g, out_bf16, out_f32, copy_mode, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2,
              step_size, bias_correction2_sqrt, eps, grad_scale, nchunks):
    """Update 1-D fp32 ``w``, ``m``, ``v`` in place from ``g * grad_scale``; optionally write the
    device copy (``out_bf16`` as uint16 bits, or ``out_f32``).

    The scalars arrive precomputed in double precision and rounded once, as torch does:
    ``decay`` is ``1 - lr * weight_decay`` (AdamW) or ``weight_decay`` (Adam), ``step_size`` is
    ``lr / (1 - beta1^t)``. Each chunk loops from 0 over slices so that numba drops its
    negative-index checks and LLVM vectorizes the loop.
    """
    n = w.shape[0]
    chunk = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        lo = c * chunk
        hi = min(n, lo + chunk)
        ws, ms, vs, gs = w[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi]
        if copy_mode == 1:
            ob = out_bf16[lo:hi]
            for i in range(hi - lo):
                ob[i] = _bf16(_adam(ws, ms, vs, gs, i, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2, step_size,
                                     bias_correction2_sqrt, eps, grad_scale))
        elif copy_mode == 2:
            of = out_f32[lo:hi]
            for i in range(hi - lo):
                of[i] = _adam(ws, ms, vs, gs, i, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2, step_size,
                                     bias_correction2_sqrt, eps, grad_scale)
        else:
            for i in range(hi - lo):
                _adam(ws, ms, vs, gs, i, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2, step_size,
                                     bias_correction2_sqrt, eps, grad_scale)


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
