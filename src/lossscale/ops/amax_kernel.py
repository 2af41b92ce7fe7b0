"""``max |x|`` over many CUDA tensors in one Triton kernel with one small output (optional: needs ``triton``).

torch's multi-tensor inf-norm (``torch._foreach_norm(ord=inf)``) returns one tensor per input, each its own
allocation, so its host time grows with the number of tensors; torch has no reduction over a list of tensors with
one output. This kernel takes a table of the tensors' addresses and sizes, built on the host at each call (no
address needs to stay put between steps), and writes one partial maximum per (tensor, chunk) program; torch's
``max`` reduces them.

Per call: the table (one pinned host tensor, copied without waiting), one output vector, one kernel launch, one
``max``: a constant number of host ops whatever the number of tensors. No host read, no synchronisation. The first
call per dtype compiles the kernel (Triton's cache keeps it on disk). Its worth, measured on an H200: docs/cuda.md.

:func:`lossscale.ops.overflow.largest_magnitude` calls :func:`amax` on a CUDA device where ``triton`` imports and
the environment variable ``LOSSSCALE_TRITON`` is not ``0``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

#: Values each program reads (its chunk of one tensor), and per loop iteration.
CHUNK = 65536
BLOCK = 1024
#: Programs per tensor at most (CUDA's limit on a grid's second dimension).
MAX_CHUNKS = 65535

#: The dtypes read, as the kernel's ``KIND``.
_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ADDRESS = torch.Tensor.data_ptr
_SIZE = torch.Tensor.numel
_CONTIGUOUS = torch.Tensor.is_contiguous
_PLAIN = {torch.Tensor}
#: The dtypes whose kernel has compiled and launched once in this process (errors after that are not Triton's setup).
_LAUNCHED: set[torch.dtype] = set()


@triton.jit
def _amax_kernel(table, partials, CHUNK: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: N803  # Triton reads the annotations (pointers: none, constants: tl.constexpr, capitalised)
    """Program (t, c): max |x| over values [c * CHUNK, (c + 1) * CHUNK) of tensor t (0 past its end; NaN where a
    value is NaN), stored at partials[t * chunks + c]. ``table``: int64 [2 * tensors], the addresses then the
    sizes; ``KIND``: the tensors' dtype (:data:`_KINDS`)."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    tensors = tl.num_programs(0)
    chunks = tl.num_programs(1)
    address = tl.load(table + t)
    if KIND == 0:
        base = address.to(tl.pointer_type(tl.float32))
    elif KIND == 1:
        base = address.to(tl.pointer_type(tl.float16))
    else:
        base = address.to(tl.pointer_type(tl.bfloat16))
    size = tl.load(table + tensors + t)
    start = c.to(tl.int64) * CHUNK
    end = tl.minimum(size - start, CHUNK)  # values of this chunk (<= 0 past the tensor's end)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, end, BLOCK):
        offs = start + k + tl.arange(0, BLOCK)
        x = tl.abs(tl.load(base + offs, mask=offs < size, other=0.0).to(tl.float32))
        acc = tl.where((x > acc) | (x != x), x, acc)  # a NaN, once taken, stays: nothing is > NaN
    nan = tl.sum((acc != acc).to(tl.int32), axis=0) > 0
    result = tl.where(nan, float("nan"), tl.max(acc, axis=0))
    tl.store(partials + t.to(tl.int64) * chunks + c, result)


def amax(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``max |x|`` over ``tensors`` (CUDA tensors of one device and dtype, at least one) as a 0-d float32 on their
    device: inf where a value is infinite, NaN where one is NaN (an empty tensor counts as 0). One kernel and one
    ``max``; no host read.

    None, with nothing launched, where the kernel does not take them: a dtype other than float32, float16 and
    bfloat16; a tensor that is not contiguous, or not a plain ``torch.Tensor`` (a subclass's memory is its own); one
    of more than ``CHUNK * MAX_CHUNKS`` values; a CUDA graph capture under way (the table's host copy would be read
    again at each replay).

    Raises:
        RuntimeError: the first launch for a dtype failed (Triton could not compile or load the kernel here: no C
            compiler, an unsupported GPU); the message names ``LOSSSCALE_TRITON=0``, and the cause is chained."""
    first = tensors[0]
    if (
        first.dtype not in _KINDS
        or torch.cuda.is_current_stream_capturing()
        or set(map(type, tensors)) != _PLAIN
        or not all(map(_CONTIGUOUS, tensors))
    ):
        return None
    sizes = list(map(_SIZE, tensors))
    chunks = max(1, -(-max(sizes) // CHUNK))
    if chunks > MAX_CHUNKS:
        return None
    device = first.device
    table = torch.tensor(list(map(_ADDRESS, tensors)) + sizes, dtype=torch.int64, pin_memory=True)
    table = table.to(device, non_blocking=True)
    partials = torch.empty(len(sizes) * chunks, dtype=torch.float32, device=device)
    try:
        with torch.cuda.device(device):
            # no multiply-add to fuse: said explicitly, as triton 3.9 warns where the option is left to its default
            _amax_kernel[(len(sizes), chunks)](
                table, partials, CHUNK=CHUNK, BLOCK=BLOCK, KIND=_KINDS[first.dtype], enable_fp_fusion=False
            )
    except Exception as err:
        if first.dtype in _LAUNCHED:
            raise
        raise RuntimeError(
            f"lossscale.ops.amax_kernel: the Triton kernel for {first.dtype} failed at its first "
            f"launch on {device} ({type(err).__name__}: {err}). Set the environment variable "
            f"LOSSSCALE_TRITON=0 to read the largest gradient magnitude with torch's multi-tensor "
            f"inf-norm instead."
        ) from err
    _LAUNCHED.add(first.dtype)
    return partials.max()
