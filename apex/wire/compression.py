"""An lz4 array received but not yet decompressed, and its decompression straight into a
buffer of the receiver's (the system's liblz4 through ctypes, where there is one: python-lz4
can only return new bytes, which would cost a copy of every frame)."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Any

import lz4.block
import numpy as np

from apex.errors import ProtocolError


def _load_liblz4() -> Any:
    """The system's liblz4 (decompresses into a buffer we own), or None: then a copy."""
    path = ctypes.util.find_library("lz4")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        function = lib.LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


LZ4_DECOMPRESS_SAFE = _load_liblz4()


@dataclass(frozen=True)
class Compressed:
    """A validated lz4 array not yet decompressed (``decode(..., lazy=True)``)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    payload: Any  # the received frame's bytes

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def decompress(self) -> np.ndarray:
        try:
            data = lz4.block.decompress(self.payload, uncompressed_size=self.nbytes)
        except (lz4.block.LZ4BlockError, ValueError) as e:
            raise ProtocolError(f"array {self.name!r}: corrupt lz4 payload ({e})") from None
        if len(data) != self.nbytes:
            raise ProtocolError(f"array {self.name!r}: lz4 payload holds {len(data)} bytes, layout says {self.nbytes}")
        return np.frombuffer(data, self.dtype).reshape(self.shape)

    def decompress_into(self, out: np.ndarray) -> None:
        """Decompresses into ``out`` (C-contiguous, this dtype and shape) without an
        intermediate copy; on ProtocolError ``out`` holds garbage."""
        if out.dtype != self.dtype or out.shape != self.shape or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"decompress_into needs a writable C-contiguous {self.dtype}{list(self.shape)} array")
        if LZ4_DECOMPRESS_SAFE is None or self.nbytes == 0:
            out[...] = self.decompress()
            return
        source = np.frombuffer(self.payload, np.uint8)
        if len(source) > 2**31 - 1 or self.nbytes > 2**31 - 1:
            out[...] = self.decompress()
            return
        written = LZ4_DECOMPRESS_SAFE(source.ctypes.data, out.ctypes.data, len(source), self.nbytes)
        if written != self.nbytes:
            raise ProtocolError(f"array {self.name!r}: corrupt lz4 payload (decoded {written} of {self.nbytes} bytes)")
