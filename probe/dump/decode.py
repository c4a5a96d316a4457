"""Stored array -> numpy array of the tensor's values, with numpy only (no torch).

The inverse of encode.py. Dtypes numpy has come back unchanged; the others come back in
the smallest numpy dtype that holds every value exactly:

    bfloat16                      -> float32   (the 16 stored bits are the top half)
    float8_e4m3fn, float8_e4m3fnuz,
    float8_e5m2, float8_e5m2fnuz,
    float8_e8m0fnu                -> float32   (256-entry lookup table per format)
    complex32                     -> complex64 (from the stored float16 pairs)

"""

from __future__ import annotations

import functools

import numpy as np

from probe.dump import schema

#: torch dtype names stored as themselves
NATIVE_DTYPES = (
    "float16", "float32", "float64", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)

# float8 formats: (exponent bits, mantissa bits, exponent bias, has sign, special-value rule)
#   "fn":   no infinities; all-ones exponent and mantissa is NaN (e4m3fn)
#   "ieee": all-ones exponent is inf (mantissa 0) or NaN (e5m2)
#   "fnuz": no infinities, no negative zero; the pattern 0x80 is the only NaN
#   "e8m0": unsigned powers of two; 0xFF is NaN, there is no zero
_FLOAT8_FORMATS = {
    "float8_e4m3fn": (4, 3, 7, True, "fn"),
    "float8_e4m3fnuz": (4, 3, 8, True, "fnuz"),
    "float8_e5m2": (5, 2, 15, True, "ieee"),
    "float8_e5m2fnuz": (5, 2, 16, True, "fnuz"),
    "float8_e8m0fnu": (8, 0, 127, False, "e8m0"),
}

_DECODED_DTYPES = {
    **{name: np.dtype(name) for name in NATIVE_DTYPES},
    "bfloat16": np.dtype(np.float32),
    **{name: np.dtype(np.float32) for name in _FLOAT8_FORMATS},
    "complex32": np.dtype(np.complex64),
}


class UnknownDtypeError(ValueError):
    """A stored dtype name this version of probe cannot decode."""


def known_dtype_names() -> tuple[str, ...]:
    return tuple(sorted(_DECODED_DTYPES))


def numpy_dtype_for(dtype_name: str) -> np.dtype:
    """The numpy dtype from_storage returns for a torch dtype name."""
    try:
        return _DECODED_DTYPES[dtype_name]
    except KeyError:
        raise UnknownDtypeError(f"unknown tensor dtype {dtype_name!r}") from None


def storage_dtype_for(dtype_name: str) -> np.dtype:
    """The numpy dtype a tensor of that torch dtype is stored in."""
    numpy_dtype_for(dtype_name)  # validates the name
    return np.dtype(schema.STORAGE_DTYPES.get(dtype_name, dtype_name))


def from_storage(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """Decode a stored array to the tensor's values (exact, see the module doc)."""
    array = np.asarray(array)
    expected = storage_dtype_for(dtype_name)
    if array.dtype.newbyteorder("=") != expected:
        raise ValueError(f"a {dtype_name} tensor is stored as {expected}, found {array.dtype}")
    array = array.astype(expected, copy=False)  # a file written on a big-endian machine
    if dtype_name == "bfloat16":
        # one pass into a fresh uint32 array (astype + shift would make two)
        widened = np.empty(array.shape, dtype=np.uint32)
        np.left_shift(array, 16, out=widened, dtype=np.uint32)
        return widened.view(np.float32)
    if dtype_name in _FLOAT8_FORMATS:
        return float8_table(dtype_name)[array]
    if dtype_name == "complex32":
        if array.ndim == 0 or array.shape[-1] != 2:
            raise ValueError(f"complex32 is stored with a trailing axis of 2, found shape {array.shape}")
        # float32 pairs reinterpreted in place: arithmetic (re + 1j*im) would turn inf into nan
        pairs = np.ascontiguousarray(array.astype(np.float32))
        return pairs.view(np.complex64).reshape(array.shape[:-1])
    return array


@functools.cache
def float8_table(dtype_name: str) -> np.ndarray:
    """float32 value of each of the 256 bit patterns of a float8 format (read-only)."""
    exp_bits, man_bits, bias, signed, rule = _FLOAT8_FORMATS[dtype_name]
    bits = np.arange(256, dtype=np.int64)
    mantissa = bits & ((1 << man_bits) - 1)
    exponent = (bits >> man_bits) & ((1 << exp_bits) - 1)
    negative = signed & (bits >> 7).astype(bool)

    fraction = mantissa / float(1 << man_bits)
    normal = np.ldexp(1.0 + fraction, (exponent - bias).astype(np.int32))
    subnormal = np.ldexp(fraction, 1 - bias)
    if rule == "e8m0":  # no mantissa, no subnormals, no zero
        values = np.ldexp(1.0, (exponent - bias).astype(np.int32))
    else:
        values = np.where(exponent == 0, subnormal, normal)
    values = np.where(negative, -values, values)

    top_exponent = exponent == (1 << exp_bits) - 1
    if rule == "fn":
        values[top_exponent & (mantissa == (1 << man_bits) - 1)] = np.nan
    elif rule == "ieee":
        values[top_exponent & (mantissa == 0)] = np.copysign(np.inf, values[top_exponent & (mantissa == 0)])
        values[top_exponent & (mantissa != 0)] = np.nan
    elif rule == "fnuz":
        values[0x80] = np.nan
    elif rule == "e8m0":
        values[0xFF] = np.nan
    table = values.astype(np.float32)
    table.setflags(write=False)
    return table
