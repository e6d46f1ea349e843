"""Metadata read with arrays parsed whole equals gguf's own element-by-element reading, and the tensors are gguf's."""

from __future__ import annotations

import gguf
import numpy as np

from tokenloop.models.gguf_metadata import open_gguf, read_metadata


def test_metadata_and_tensors_equal_ggufs_own_reading(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.tokens", ["<s>", "", "héllo", "😀 x", "a" * 300])  # an empty string, multi-byte, a long one
    writer.add_array("test.scores", [0.5, -1.25, 3.0])
    writer.add_array("test.types", [1, 2, 3, 6])
    writer.add_array("test.flags", [True, False])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])  # arrays of arrays take gguf's own parse
    writer.add_string("test.name", "tiny")
    writer.add_uint32("test.count", 7)
    writer.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b", np.ones(5, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    expected = {name: field.contents() for name, field in theirs.fields.items() if not name.startswith("GGUF.")}
    assert read_metadata(ours) == expected
    assert expected["test.tokens"][2] == "héllo" and expected["test.scores"] == [0.5, -1.25, 3.0]
    for mine, gguf_tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data_offset) == (
            gguf_tensor.name,
            gguf_tensor.tensor_type,
            gguf_tensor.data_offset,
        )
        assert np.array_equal(mine.data, gguf_tensor.data)
