"""numba intrinsics the host kernels share (:mod:`hetero.embedding._numba_kernels`,
:mod:`hetero.dynamic._kernels`): a software prefetch, an atomic add and an atomic max. Imported by kernel modules
only (it imports numba).

The prefetch brings the line into L2, not L1 (``prefetcht1``): a core has only about 16 L1 fill
buffers, which three rows (weight, m, v) times 12 rows ahead oversubscribe, while L2 tracks more
misses; the LazyAdam train step took 0.25-0.33 ms less (of 3.9-4.0) than with write prefetches
into L1, in interleaved runs on the 2-core benchmark machine.
"""

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, arr, row):
    """Prefetch the cache line of ``arr[row]`` (1-D) or ``arr[row, 0]`` into L2 (``prefetcht1``)."""

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        idx = [args[1]] + [zero] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer2(
            context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
            cgutils.unpack_tuple(builder, ary.strides), aryty.layout, idx, wraparound=False, boundscheck=False,
        )
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])  # read, locality 2, data
        return context.get_dummy_value()

    return types.void(arr, types.intp), codegen


@intrinsic
def prefetch_address(typingctx, address):
    """Prefetch the cache line at byte ``address`` (an int64, as a ctypes or numpy data pointer)
    into L2 (``prefetcht1``); an address not mapped is dropped, never a fault."""

    def codegen(context, builder, sig, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch")
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(2), i32(1)])  # read, locality 2, data
        return context.get_dummy_value()

    return types.void(types.int64), codegen


def _atomic(op: str):  # noqa: ANN202 - a codegen function
    """The codegen of an atomic read-modify-write ``op`` (LLVM's ``atomicrmw``) of ``arr[index]``."""

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer2(
            context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
            cgutils.unpack_tuple(builder, ary.strides), aryty.layout, [args[1]], wraparound=False, boundscheck=False,
        )
        return builder.atomic_rmw(op, ptr, args[2], "monotonic")

    return codegen


@intrinsic
def fetch_add(typingctx, arr, index, value):
    """Atomically add ``value`` to ``arr[index]`` (1-D integer array); returns the old value."""
    return arr.dtype(arr, types.intp, arr.dtype), _atomic("add")


@intrinsic
def fetch_max(typingctx, arr, index, value):
    """Atomically ``arr[index] = max(arr[index], value)`` (1-D signed integer array); returns the
    old value."""
    return arr.dtype(arr, types.intp, arr.dtype), _atomic("max")
