"""float16 and float32 values in numba code, one at a time, by the CPU's own instructions.

numba has no float16 type on the CPU: kernels hold float16 arrays as ``int16`` bit
patterns (``array.view(np.int16)``) and convert each value with these intrinsics, which
LLVM vectorizes (F16C's ``vcvtph2ps`` / ``vcvtps2ph`` on x86). Both the parameter
servers' row kernels and the NN worker's pooling of float16 rows use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["f16_bits", "f16_value", "fma32", "llvm_f32", "numba_intrinsic"]


def numba_intrinsic(typer: Callable[..., Any]) -> Callable[..., Any]:
    """``numba.extending.intrinsic``, typed as numba code calls what it makes: numba's
    stubs count ``typingctx`` among the call's arguments, which no call passes."""
    return intrinsic(typer)


@numba_intrinsic
def f16_value(typingctx, bits):
    """float16 bits (int16) as float32: the CPU's conversion (F16C on x86), exact."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@numba_intrinsic
def f16_bits(typingctx, value):
    """float32 as float16 bits (int16), rounded to nearest even by the CPU (infinity past
    float16's range), as numpy's and torch's casts round."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


def llvm_f32(builder: ir.IRBuilder, name: str, *args: ir.Value) -> ir.Value:
    """A call of LLVM's float32 intrinsic ``name`` (which vectorizes)."""
    f32 = ir.FloatType()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * len(args)),
                                        name)
    return builder.call(fn, list(args))


@numba_intrinsic
def fma32(typingctx, x, y, z):
    """``x * y + z`` in float32, rounded once."""
    def codegen(context, builder, signature, args):
        return llvm_f32(builder, "llvm.fma.f32", *args)
    return types.float32(types.float32, types.float32, types.float32), codegen
