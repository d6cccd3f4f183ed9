"""numba kernels of the host Adam/AdamW: one streaming pass per tensor, parallel over chunks.

Per element the update reads the fp32 master weight, the two moments and the gradient and writes
the master and the moments and, in the same pass, the weight for the device. The gradient arrives
in the device's dtype (bf16 device weights: bf16, read as uint16 bits and widened exactly), and
the device weight is written over the gradient it was computed from: that cache line is already
loaded, so the copy-out costs no extra read-for-ownership. A bf16 step moves
4+4+4+2 + 4+4+4+2 = 28 bytes per parameter, as much as ``torch.optim.AdamW(fused=True)`` moves
without any copy-out (measured: a separate bf16 output array, with its read-for-ownership, cost
7%; non-temporal stores were 2x slower on the benchmark VM). Chunks are contiguous and
independent, so results do not depend on the thread count.

The arithmetic follows ``torch.optim.AdamW``/``Adam`` (single-tensor path) operation by operation:
``m = lerp(m, g, 1 - beta1)``; ``v = beta2 v + (1 - beta2) g^2``;
``w -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)``; AdamW decays ``w *= 1 - lr wd`` first,
Adam adds ``wd w`` to the gradient.
"""

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

# Value-safe fast-math only: FMA contraction and reciprocal/function approximations that LLVM
# needs to vectorize; no nnan/ninf, which would let it delete the NaN handling below.
FAST = {"contract", "arcp", "afn"}


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of a float32, as uint32 (a register bitcast: no memory round trip)."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, x):
    """float32 from bf16 bits (uint16): exact, a shift and a register bitcast."""

    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


def _to_f32(x):
    """A gradient element as float32: identity for float32, widening for bf16 bits (uint16)."""


@overload(_to_f32, inline="always")
def _to_f32_impl(x):
    if x == types.uint16:
        return lambda x: _bf16_bits_to_f32(x)
    return lambda x: np.float32(x)


@njit(cache=True, nogil=True, inline="always", fastmath=FAST)
def _bf16(x):
    """Round float32 to bf16 bits, nearest-even, branch-free; NaN stays a (quiet) NaN."""
    b = _f32_bits(x)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(((b >> np.uint32(16)) | np.uint32(0x40)) if nan else rounded)


def _like(x, arr):
    """float32 ``x`` in ``arr``'s element type: bf16 bits (rounded) for uint16, else float32."""


@overload(_like, inline="always")
def _like_impl(x, arr):
    if arr.dtype == types.uint16:
        return lambda x, arr: _bf16(x)
    return lambda x, arr: x


@njit(cache=True, nogil=True, inline="always", fastmath=FAST)
def _adam(w, m, v, g, i, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, grad_scale):
    gi = _to_f32(g[i]) * grad_scale
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
def adam_step(w, m, v, g, copy_out, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2, step_size,
              bias_correction2_sqrt, eps, grad_scale, nchunks):
    """Update 1-D fp32 ``w``, ``m``, ``v`` in place from ``g * grad_scale``; with ``copy_out``,
    overwrite ``g`` with the new weight in ``g``'s type. ``g`` is float32, or bf16 as uint16 bits.

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
        if copy_out:
            for i in range(hi - lo):
                gs[i] = _like(_adam(ws, ms, vs, gs, i, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2,
                                    step_size, bias_correction2_sqrt, eps, grad_scale), gs)
        else:
            for i in range(hi - lo):
                _adam(ws, ms, vs, gs, i, decay, decoupled, one_minus_beta1, beta2, one_minus_beta2, step_size,
                      bias_correction2_sqrt, eps, grad_scale)


@njit(cache=True, nogil=True, parallel=True)
def sum_of_squares(g, nchunks):
    """``sum(g * g)`` in float64 (for the global gradient norm), and whether all of ``g`` is finite.

    ``g`` is float32, or bf16 as uint16 bits."""
    n = g.shape[0]
    chunk = (n + nchunks - 1) // nchunks
    partial = np.zeros(nchunks, np.float64)
    finite = np.ones(nchunks, np.bool_)
    for c in prange(nchunks):
        acc = 0.0
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            x = np.float64(_to_f32(g[i]))
            acc += x * x
            if not np.isfinite(x):
                finite[c] = False
        partial[c] = acc
    return partial.sum(), finite.all()
