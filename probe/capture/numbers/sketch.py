"""Random-projection sketches: k numbers per tensor that let compare *measure* ||a - b||.

A sketch is ``y = R x`` where x is the tensor's n values (flattened row-major, as real
numbers: see ``sketch_values``) and R is a k x n matrix of +-1. Two runs use the same R, so
``y_a - y_b = R (a - b)``, and ``mean_j (y_a - y_b)_j^2`` estimates ``||a - b||^2`` without
either tensor (probe/comparison/sketch.py turns that into a rel L2 with a confidence band).

The matrix is never built. Element i sits at row r = i // BLOCK, column c = i % BLOCK of
the tensor viewed as (rows, BLOCK), zero-padded at the end; row r belongs to group
g = r % GROUPS of super-row m = r // GROUPS, and

    R[j, i] = F[m] * S[g, j] * P[c, j]          F, S, P: fixed +-1 tables

Computed in two steps, both one pass or less over the data:

    Z = sum_m F[m] * X[m]          fold: X viewed as (super-rows, GROUPS, BLOCK); a
                                    matrix-vector product, one multiply-add per element
    y = sum_g S[g, :] * (Z[g, :] @ P)   a (GROUPS, BLOCK) @ (BLOCK, k) product: constant cost

A dense k-row projection would cost k multiply-adds per element (2.5x the statistics on
CPU); the fold costs one. Tensors of at most GROUPS rows are not folded (F[0] only), so
their sketch is the plain dense projection. Properties the comparison relies on:

* Deterministic and device-independent: the signs are a hash of (index, j), made with
  numpy on the CPU, never a random generator (capture must not move any RNG state).
* The coefficient of element i depends on i only, not on n: padding is zeros. So a bulk
  pass can sketch many tensors at once (docs/format.md, "Sketch").
* Prefix-stable in k: the first k numbers of a size-k' sketch (k' > k) are the size-k one.
* Unbiased: two distinct elements' coefficients are uncorrelated over the tables (they
  differ in c, in g, or in m), and E[(R d)_j^2] = ||d||^2 for every j. The k numbers are
  independent given F, so the mean of their squares spreads like chi-square(k)/k times the
  folded ||Z_d||^2 / ||d||^2, which is 1 up to a spread that shrinks with the number of
  columns the difference covers (worst, every row of d equal: chi-square(GROUPS)/GROUPS;
  that case, a constant offset, is what the mean statistic measures exactly).
* BLOCK = 251 is prime, so the (rows, BLOCK) view never lines up with power-of-two tensor
  dimensions and structured differences do not factor into products of the tables.

Accumulation: in float64 for float64, complex128, integer and bool tensors, in float32
otherwise (float16, bfloat16 and float8 are widened to float32 exactly); the final sum over
groups in float64. On CUDA, when TF32 matmuls are allowed, float32 values are projected in
float64 instead (TF32 would round them to 10 bits first). The float32 rounding is the
sketch's own error floor: about eps32 * (sqrt(BLOCK) + sqrt(super-rows)) of ||x||
(comparison/sketch.py, ``rounding_floor``).
"""

from __future__ import annotations

import numpy as np
import torch

from probe.capture.numbers.host_view import host_array

#: columns of the (rows, BLOCK) view: the inner products that run in the accumulation dtype
BLOCK = 251
#: rows per super-row: the fold keeps GROUPS x BLOCK numbers, whatever the tensor's size
GROUPS = 16
#: the config default; sizes must stay below 2**20 for the sign hash (config.SKETCH_SIZE_MAX is 1024)
DEFAULT_SIZE = 16
_SEED_COLUMNS = 0x5EED_0001
_SEED_ROWS = 0x5EED_0002
_SEED_FOLD = 0x5EED_0003
_MASK = (1 << 64) - 1

#: ("numpy" | device, dtype, k) -> (P (BLOCK, k), S (GROUPS, k)); (... , "fold") -> F
_tables: dict = {}


def signs(seed: int, count: int, k: int) -> np.ndarray:
    """+-1.0 of shape (count, k): entry (i, j) is the top bit of splitmix64(seed, i, j)."""
    i = np.arange(count, dtype=np.uint64)[:, None]
    j = np.arange(k, dtype=np.uint64)[None, :]
    z = (i << np.uint64(20)) | j  # k <= config.SKETCH_SIZE_MAX < 2**20: (i, j) pairs never collide
    z = z + np.uint64((seed * 0x9E3779B97F4A7C15) & _MASK)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.where((z >> np.uint64(63)) == 1, -1.0, 1.0)


def column_signs(k: int) -> np.ndarray:
    """P, the (BLOCK, k) table every folded row is multiplied by."""
    return signs(_SEED_COLUMNS, BLOCK, k)


def row_signs(k: int) -> np.ndarray:
    """S, the (GROUPS, k) table that combines the folded rows' products."""
    return signs(_SEED_ROWS, GROUPS, k)


def fold_signs(count: int) -> np.ndarray:
    """F, one sign per super-row (GROUPS x BLOCK elements)."""
    return signs(_SEED_FOLD, count, 1)[:, 0]


def projection_tables(where, dtype, k: int):
    """(P, S) in the values' dtype (a sign flip is exact in any dtype) on a device or numpy."""
    key = (where, dtype, k)
    found = _tables.get(key)
    if found is None:
        columns, rows = column_signs(k), row_signs(k)
        if where == "numpy":
            found = (columns.astype(dtype), rows.astype(dtype))
        else:
            found = (torch.from_numpy(columns).to(device=where, dtype=dtype),
                     torch.from_numpy(rows).to(device=where, dtype=dtype))
        _tables[key] = found
    return found


def fold_sign_table(where, dtype, count: int):
    """F with at least `count` entries, grown by doubling from 4096 (16M elements): the copy
    to a device (which synchronises) happens a handful of times per process, never per tensor."""
    key = (where, dtype, "fold")
    table = _tables.get(key)
    if table is None or table.shape[0] < count:
        size = max(count, 4096, 2 * (table.shape[0] if table is not None else 0))
        values = fold_signs(size)
        table = values.astype(dtype) if where == "numpy" else torch.from_numpy(values).to(device=where, dtype=dtype)
        _tables[key] = table
    return table


def sketch_values(tensor: torch.Tensor) -> torch.Tensor:
    """The real numbers a tensor's sketch is made of, flat, in their accumulation dtype.

    Floats as themselves (half-width and float8 widened to float32); complex as (real,
    imaginary) pairs, the way compare reads complex tensors; integers and bool as their
    values in float64 (bool as 0/1)."""
    x = tensor.detach()
    dtype = x.dtype
    if dtype.is_complex:
        x = torch.view_as_real(x.resolve_conj().resolve_neg())
        dtype = x.dtype
    if dtype == torch.float64:
        accumulate = torch.float64
    elif dtype.is_floating_point:
        accumulate = torch.float32
    else:
        accumulate = torch.float64
    if accumulate == torch.float32 and x.device.type == "cuda" and tf32_allowed():
        accumulate = torch.float64
    return x.reshape(-1).to(accumulate)


def tf32_allowed() -> bool:
    """CUDA float32 matmuls may round their inputs to TF32 now."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _numpy_matvec(vector, matrix, out=None):
    # BLAS gemv: twice einsum's speed up to NUMPY_MAX values, and measured single-threaded
    # there (the same time with OPENBLAS_NUM_THREADS=1 and 2; it threads from about 1M values,
    # which torch folds instead)
    return np.dot(vector, matrix, out=out)


def fold_values(x, fold, zeros):
    """Z = sum over super-rows m of F[m] * (super-row m of x, zero-padded), as (rows, BLOCK)
    with rows = min(GROUPS, the tensor's rows): the rows a small tensor leaves empty are
    skipped. For torch tensors on any device (zeros(size) makes the output); fold_into is the
    same fold of a CPU array, written in place."""
    n = x.shape[0]
    span = GROUPS * BLOCK
    supers, rest = divmod(n, span)
    used = GROUPS if supers else -(-rest // BLOCK)
    folded = zeros(used * BLOCK)
    if supers:
        # one matrix-vector product: a multiply-add per element, in the values' dtype
        folded += fold[:supers] @ x[: supers * span].reshape(supers, span)
    if rest:
        folded[:rest] += fold[supers] * x[supers * span:]
    return folded.reshape(used, BLOCK)


def combine_folded(folded, columns, rows):
    """y = sum_g S[g, :] * (Z[g, :] @ P): a (rows, BLOCK) @ (BLOCK, k) product."""
    return (folded @ columns) * rows[: folded.shape[0]]


def sketch(tensor: torch.Tensor, k: int = DEFAULT_SIZE) -> torch.Tensor:
    """The (k,) float64 sketch of a tensor, on its device, without a host synchronisation.

    The caller guards numel() == 0 (an empty tensor has no sketch)."""
    flat = sketch_values(tensor)
    device, dtype = flat.device, flat.dtype
    columns, rows = projection_tables(device, dtype, k)
    fold = fold_sign_table(device, dtype, flat.numel() // (GROUPS * BLOCK) + 1)
    folded = fold_values(flat, fold, lambda size: torch.zeros(size, device=device, dtype=dtype))
    return combine_folded(folded, columns, rows).sum(0, dtype=torch.float64)


def pack(values: np.ndarray) -> bytes:
    """A record's sketch as the capture side holds it until the writer: the k float64 numbers'
    bytes in the machine's order (one object per record instead of k + 1; the writer joins
    them into the /records/sketch table in one call). ``unpack`` reverses it."""
    return np.asarray(values, dtype=np.float64).tobytes()


def unpack(sketched: bytes | None) -> tuple | None:
    """The floats of a packed sketch (None stays None)."""
    return None if sketched is None else tuple(np.frombuffer(sketched, dtype=np.float64).tolist())


def host_sketch(tensor: torch.Tensor, k: int) -> bytes | None:
    """sketch() of a CPU tensor, packed (``pack``); None when k is 0 or the values cannot be
    read as numbers (a quantized tensor): the record keeps its statistics."""
    if k <= 0:
        return None
    try:
        return _host_sketch(tensor, k)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


#: CPU tensors up to this many elements are folded with numpy (a few us instead of ~15 us of
#: torch dispatch, on one thread). Larger ones are folded by torch, whose BLAS honours
#: torch.set_num_threads (numpy's OpenBLAS would take every core from about 1M values; the
#: dense path's products stay under OpenBLAS's threading threshold).
NUMPY_MAX = 1 << 18


#: CPU tensors up to this many values skip the fold (k multiply-adds per value, but fewer calls)
DENSE_MAX = 64 * BLOCK


def row_signs_table(dtype, k: int, rows: int) -> np.ndarray:
    """(rows, k): F[r // GROUPS] * S[r % GROUPS], the sign each unfolded row's products get."""
    key = ("rows", dtype, k)
    table = _tables.get(key)
    if table is None or table.shape[0] < rows:
        size = max(rows, -(-DENSE_MAX // BLOCK))
        r = np.arange(size)
        table = (fold_signs(size // GROUPS + 1)[r // GROUPS][:, None] * row_signs(k)[r % GROUPS]).astype(dtype)
        _tables[key] = table
    return table


def _host_sketch(tensor: torch.Tensor, k: int) -> bytes:
    dtype = tensor.dtype
    if dtype is torch.float32 or dtype is torch.float64:
        flat = tensor.detach().reshape(-1)  # the common case, without sketch_values' dispatches
    else:
        flat = sketch_values(tensor)
    return array_sketch(host_array(flat), k)


def array_sketch(values: np.ndarray, k: int) -> bytes:
    """host_sketch of a float32/float64 numpy array (any shape: read row-major), for callers
    that already hold the tensor's numpy view (stats.host_stats_and_sketch): no torch call."""
    values = values.reshape(-1)
    n = values.size
    if n <= BLOCK:
        # one row (targets, masks, small biases): its products signed S[0] (F[0] = +1) are
        # the sketch, so one product with the pre-signed columns, no padding and no sum
        return pack(np.dot(values, _first_row_columns(values.dtype, k)[:n]))
    columns, rows = projection_tables("numpy", values.dtype, k)
    if n <= DENSE_MAX:
        # small tensors (most records of a small model): no fold; each row's products get
        # their sign F[r // GROUPS] * S[r % GROUPS] directly, in fewer numpy calls
        used = -(-n // BLOCK)
        if n != used * BLOCK:
            padded = np.zeros(used * BLOCK, dtype=values.dtype)
            padded[:n] = values
            values = padded
        products = values.reshape(used, BLOCK) @ columns
        signed = row_signs_table(values.dtype, k, used)
        return pack(np.multiply(products, signed[:used]).sum(0, dtype=np.float64))
    folded = np.empty(GROUPS * BLOCK, dtype=values.dtype)
    used = fold_into(values, folded)
    folded = folded[: used * BLOCK].reshape(used, BLOCK)
    return pack(combine_folded(folded, columns, rows).sum(0, dtype=np.float64))


def _first_row_columns(dtype, k: int) -> np.ndarray:
    """P * S[0], in dtype: the signed columns a tensor's first row is projected with (a sign
    flip is exact, so signing the table gives the same numbers as signing the products)."""
    key = ("first row", dtype, k)
    table = _tables.get(key)
    if table is None:
        columns, rows = projection_tables("numpy", dtype, k)
        table = _tables[key] = columns * rows[0]
    return table


def _aligned_empty(size: int, dtype) -> np.ndarray:
    """np.empty(size, dtype) starting on a 64-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(size + 64 // itemsize, dtype=dtype)
    skip = (-raw.ctypes.data % 64) // itemsize
    return raw[skip: skip + size]


def fold_rows(size: int) -> int:
    """Rows of the fold of `size` values (fold_into): GROUPS, or fewer for a tensor of fewer."""
    return GROUPS if size >= GROUPS * BLOCK else -(-size // BLOCK)


def fold_into(values: np.ndarray, out: np.ndarray) -> int:
    """Write Z, the fold of a flat float32/float64 array (``fold_values``), to the contiguous
    ``out[:rows * BLOCK]`` of the same dtype and return rows (at most GROUPS). The values are
    read once; host_batch defers the (rows, BLOCK) @ (BLOCK, k) product of many such Z to one
    product."""
    n = values.size
    span = GROUPS * BLOCK
    supers, rest = divmod(n, span)
    used = fold_rows(n)
    target = out[: used * BLOCK]
    fold = fold_sign_table("numpy", values.dtype, supers + 1)
    if supers:
        body = values[: supers * span].reshape(supers, span)
        if n > NUMPY_MAX:
            # MKL's gemv rounds differently with the output's alignment (measured: each 4-byte
            # offset mod 64 gives other bits), and out is wherever the allocator put it: so
            # into a cache-line-aligned buffer, the same bits for the same values every call
            aligned = _aligned_empty(target.size, target.dtype)
            torch.mv(torch.from_numpy(body).t(), torch.from_numpy(fold[:supers]),
                     out=torch.from_numpy(aligned))
            target[:] = aligned
        else:
            _numpy_matvec(fold[:supers], body, out=target)
        if rest:
            # a sign flip as an add or a subtract: no temporary for the product
            if fold[supers] > 0:
                target[:rest] += values[supers * span:]
            else:
                target[:rest] -= values[supers * span:]
    else:
        np.multiply(values, fold[0], out=target[:rest])
        target[rest:] = 0
    return used
