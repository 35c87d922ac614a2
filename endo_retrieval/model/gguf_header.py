"""A GGUF file's header read without its weights: the metadata (architecture, tokenizer arrays) and each tensor's
shape, in a fraction of a second where the `gguf` package's reader takes tens of seconds on a 262k-token
vocabulary. What loading needs before the slow conversion: which family the file is, and how many parameters it
holds (`model.memory`)."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# GGUF value types: (struct format, numpy dtype) of the fixed-size ones
_FIXED = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
          5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
          11: ("<q", np.int64), 12: ("<d", np.float64)}
STRING, ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    pass


@dataclass
class GGUFHeader:
    metadata: dict = field(default_factory=dict)  # key -> value (arrays of numbers as numpy arrays, strings as lists)
    tensors: dict = field(default_factory=dict)  # name -> shape (GGUF order: fastest-varying dimension first)

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @property
    def n_parameters(self) -> int:
        return int(sum(int(np.prod(shape, dtype=np.int64)) for shape in self.tensors.values()))


class _Cursor:
    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        value = bytes(self.buf[self.at: self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return value

    def value(self, kind: int, keep: bool = True):
        if kind in _FIXED:
            return self.take(_FIXED[kind][0])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise GGUFHeaderError(f"unknown GGUF value type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _FIXED:
            dtype = np.dtype(_FIXED[item][1]).newbyteorder("<")
            out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.at).copy() if keep else None
            self.at += count * dtype.itemsize
            return out
        return [self.value(item, keep) for _ in range(count)] if keep else [self.value(item, False)
                                                                            for _ in range(count)] and None


def read_gguf_header(path: str | Path, keep: tuple[str, ...] | None = None) -> GGUFHeader:
    """The metadata and tensor shapes of a GGUF file. `keep`: key prefixes whose array values are kept (None: all;
    the tokenizer's arrays are long, so a caller that wants only the architecture and sizes passes a tuple)."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf)
            if bytes(buf[:4]) != MAGIC:
                raise GGUFHeaderError(f"{path} is not a GGUF file (it does not begin with 'GGUF')")
            c.at = 4
            version, n_tensors, n_kv = c.take("<I"), c.take("<Q"), c.take("<Q")
            if version < 2:
                raise GGUFHeaderError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
            header = GGUFHeader()
            for _ in range(n_kv):
                key, kind = c.string(), c.take("<I")
                wanted = keep is None or kind != ARRAY or key.startswith(keep)
                value = c.value(kind, wanted)
                if wanted:
                    header.metadata[key] = value
            for _ in range(n_tensors):
                name, n_dims = c.string(), c.take("<I")
                header.tensors[name] = tuple(c.take("<Q") for _ in range(n_dims))
                c.take("<I"), c.take("<Q")  # type and offset
            return header
    except (struct.error, ValueError, OSError, IndexError) as e:
        if isinstance(e, GGUFHeaderError):
            raise
        raise GGUFHeaderError(f"{path} is not a readable GGUF model file ({type(e).__name__}: {e})") from None
