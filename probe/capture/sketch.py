"""Random-projection sketches: k numbers per tensor that let compare *measure* ||a - b||.

A sketch is ``y = R x`` where x is the tensor's n values (flattened row-major, as real
numbers: see ``sketch_values``) and R is a k x n matrix of +-1. Two runs use the same R, so
``y_a - y_b = R (a - b)``, and ``mean_j (y_a - y_b)_j^2`` estimates ``||a - b||^2`` without
either tensor (probe/comparison/sketch.py turns that into a rel L2 with a confidence band).

The matrix is never built. Element i sits at row r = i // BLOCK, column c = i % BLOCK of
the tensor viewed as (ceil(n / BLOCK), BLOCK), zero-padded at the end, and
``R[j, i] = S[r, j] * P[c, j]`` with two fixed +-1 tables:

    y = sum_r S[r, :] * (X[r, :] @ P)        X: (rows, BLOCK), P: (BLOCK, k), S: (rows, k)

so a sketch is one matrix product (k multiply-adds per element, one pass over the data)
and one small row combination, on the tensor's own device with no host synchronisation.
Properties the comparison relies on:

* Deterministic and device-independent: the signs are a hash of (row or column, j), made
  with numpy on the CPU, never a random generator (capture must not move any RNG state).
* The coefficient of element i depends on i only, not on n: padding is zeros, the tail
  row uses the first (n % BLOCK) rows of P. So a bulk pass can sketch many tensors at once
  by stacking their rows (each tensor padded to a whole row) and summing each tensor's rows
  (docs/format.md, "Sketch").
* Prefix-stable in k: the first k numbers of a size-k' sketch (k' > k) are the size-k
  sketch, so sketches of two sizes compare on their common prefix.
* E[(R d)_j^2] = ||d||^2 for every j and the k rows are independent, so the mean of k
  squares is an unbiased estimate whose spread is close to chi-square with k degrees of
  freedom over k (exactly so for Gaussian-like differences).

Accumulation: the product runs in float64 for float64 and integer/bool tensors, in float32
otherwise (float16, bfloat16 and float8 are widened to float32 exactly); the row
combination always in float64. On CUDA, when TF32 matmuls are allowed, the product runs in
float64 instead, because TF32 would round the values to 10 bits first. The rounding of
the float32 product is the sketch's own error floor: about eps32 * sqrt(BLOCK) of ||x||
(comparison/sketch.py, ``rounding_floor``).
"""

from __future__ import annotations

import numpy as np
import torch

#: columns of the (rows, BLOCK) view: the inner products that run in the accumulation dtype
BLOCK = 251
#: sketch sizes must stay below 2**20 for the sign hash; config.SKETCH_SIZE_MAX (1024) is the limit
DEFAULT_SIZE = 16
_SEED_COLUMNS = 0x5EED_0001
_SEED_ROWS = 0x5EED_0002
_MASK = (1 << 64) - 1

#: (device, dtype, k) -> P (BLOCK, k); (device, k) -> S (rows, k) float64, grown by doubling
_columns: dict = {}
_rows: dict = {}


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
    """P, the (BLOCK, k) table every row of the tensor is multiplied by."""
    return signs(_SEED_COLUMNS, BLOCK, k)


def row_signs(rows: int, k: int) -> np.ndarray:
    """S, the (rows, k) table that combines the rows' products."""
    return signs(_SEED_ROWS, rows, k)


def _column_table(device: torch.device, dtype: torch.dtype, k: int) -> torch.Tensor:
    """P transposed, (k, BLOCK): the layout torch's linear() takes without a copy."""
    key = (device, dtype, k)
    table = _columns.get(key)
    if table is None:
        table = torch.from_numpy(column_signs(k).T.copy()).to(device=device, dtype=dtype)
        _columns[key] = table
    return table


def _numpy_tables(dtype: np.dtype, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(P, S with at least `rows` rows), both in dtype, for the CPU path: a sign flip is exact
    in any dtype, and one dtype keeps numpy on its fast loops."""
    key = ("numpy", dtype, k)
    found = _columns.get(key)
    if found is None or found[1].shape[0] < rows:
        size = max(rows, 256, 2 * (found[1].shape[0] if found is not None else 0))
        found = _columns[key] = (column_signs(k).astype(dtype), row_signs(size, k).astype(dtype))
    return found


def _row_table(device: torch.device, rows: int, k: int) -> torch.Tensor:
    key = (device, k)
    table = _rows.get(key)
    if table is None or table.shape[0] < rows:
        # grown by doubling from 4096 rows (1M elements): the host-to-device copy (which
        # synchronises) happens a handful of times per process, never per tensor
        size = max(rows, 4096, 2 * (table.shape[0] if table is not None else 0))
        table = _rows[key] = torch.from_numpy(row_signs(size, k)).to(device)
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
    if accumulate == torch.float32 and x.device.type == "cuda" and _tf32_allowed():
        accumulate = torch.float64
    return x.reshape(-1).to(accumulate)


def _tf32_allowed() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def sketch(tensor: torch.Tensor, k: int = DEFAULT_SIZE) -> torch.Tensor:
    """The (k,) float64 sketch of a tensor, on its device, without a host synchronisation.

    The caller guards numel() == 0 (an empty tensor has no sketch)."""
    return _project(sketch_values(tensor), k)


def _project(flat: torch.Tensor, k: int) -> torch.Tensor:
    n = flat.numel()
    full, tail = divmod(n, BLOCK)
    columns = _column_table(flat.device, flat.dtype, k)
    rows = _row_table(flat.device, full + (1 if tail else 0), k)
    result = None
    if full:
        # linear(), not mm(): on CPU it takes MKL's fast path for this narrow shape (10x mm)
        products = torch.nn.functional.linear(flat[: full * BLOCK].view(full, BLOCK), columns)
        result = (products.to(torch.float64) * rows[:full]).sum(0)
    if tail:
        last = torch.nn.functional.linear(flat[full * BLOCK:], columns[:, :tail]).to(torch.float64) * rows[full]
        result = last if result is None else result + last
    return result


#: CPU tensors up to this many elements are projected with numpy (a few us instead of ~15 us
#: of torch dispatch; OpenBLAS stays on one thread below 16 * 16384 multiply-adds). Larger
#: ones are projected by torch, whose BLAS honours torch.set_num_threads.
_NUMPY_MAX = 64 * BLOCK


def host_sketch(tensor: torch.Tensor, k: int) -> tuple | None:
    """sketch() of a CPU tensor as a tuple of Python floats; None when k is 0 or the values
    cannot be read as numbers (a quantized tensor): the record keeps its statistics."""
    if k <= 0:
        return None
    try:
        return _host_sketch(tensor, k)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


def _host_sketch(tensor: torch.Tensor, k: int) -> tuple:
    dtype = tensor.dtype
    if (dtype is torch.float32 or dtype is torch.float64) and tensor.numel() <= _NUMPY_MAX:
        flat = tensor.detach().reshape(-1)  # the common case, without sketch_values' dispatches
    else:
        flat = sketch_values(tensor)
    n = flat.numel()
    values = flat.numpy()
    full, tail = divmod(n, BLOCK)
    columns, rows = _numpy_tables(values.dtype, full + 1, k)
    if not full:
        return tuple(((values @ columns[:tail]) * rows[0]).tolist())
    if n > _NUMPY_MAX:
        # torch's BLAS honours torch.set_num_threads; numpy's OpenBLAS would take every core
        products = torch.nn.functional.linear(flat[: full * BLOCK].view(full, BLOCK),
                                              _column_table(flat.device, flat.dtype, k)).numpy()
    else:
        products = values[: full * BLOCK].reshape(full, BLOCK) @ columns
    # products in the tensor's dtype, signed rows summed in float64
    result = (products * rows[:full]).sum(0, dtype=np.float64)
    if tail:
        result += (values[full * BLOCK:] @ columns[:tail]) * rows[full]
    return tuple(result.tolist())
