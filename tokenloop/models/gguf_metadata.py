"""Read a GGUF file's key/value metadata into plain Python values."""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Memory-map a GGUF file; a truncated or corrupt file raises ValueError naming the file."""
    try:
        return gguf.GGUFReader(path)
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
            return [p.tobytes().decode("utf-8", errors="replace") for p in parts]
        if field.types[1] != gguf.GGUFValueType.ARRAY:
            return np.concatenate(parts).tolist() if parts else []
    return field.contents()
