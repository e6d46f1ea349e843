"""Read a GGUF file's key/value metadata into plain Python values."""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np


class _Reader(gguf.GGUFReader):
    """gguf's reader with metadata arrays parsed whole. gguf parses an array element by element, each through a
    few numpy views: a 262k-token vocabulary (its tokens, scores and types) took most of Gemma 3's load.
    An array of numbers becomes one part; an array of strings one part per string, its bytes (without the length
    gguf keeps beside them) copied out of the map: a slice of the memmap per string, a vocabulary's and its merges'
    100k of them, held 50 MiB of numpy objects at the peak of loading. read_metadata reads these parts; the tensors
    are gguf's own."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type, n, offs = gguf.GGUFValueType(raw_itype[0]), int(length[0]), orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, length]
        if (nptype := self.gguf_scalar_to_np.get(item_type)) is not None:
            parts.append(self._get(offs, nptype, n))
            offs += int(parts[-1].nbytes)
        elif item_type == gguf.GGUFValueType.STRING:
            raw = memoryview(self.data)
            for _ in range(n):
                size = int.from_bytes(raw[offs : offs + 8], "little")
                parts.append(bytes(raw[offs + 8 : offs + 8 + size]))
                offs += 8 + size
        else:  # arrays of arrays: gguf's own parse
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, list(range(2, len(parts))), [gguf.GGUFValueType.ARRAY, item_type]


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Memory-map a GGUF file; a truncated or corrupt file raises ValueError naming the file."""
    try:
        return _Reader(path)
    except Exception as e:  # the gguf package raises assorted errors (struct, numpy, ValueError) on bad files
        raise ValueError(f"{os.fspath(path)!r} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata field as a Python value: strings, numbers, bools and lists of them."""
    return {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _value(field: gguf.ReaderField) -> Any:
    # Arrays of scalars or strings (the tokenizer's 49k-entry vocab) are read straight from the
    # memory-mapped parts: gguf's generic contents() walks them element by element and takes seconds.
    if len(field.types) == 2 and field.types[0] == gguf.GGUFValueType.ARRAY:
        parts = [field.parts[i] for i in field.data]
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8", errors="replace") for p in parts]
        if field.types[1] != gguf.GGUFValueType.ARRAY:
            return np.concatenate(parts).tolist() if parts else []
    return field.contents()
