"""What the engine does with ``pull_block_ranges`` rows, done by hand on numpy blocks."""

from __future__ import annotations

import numpy as np


def apply_rows(rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """Rows ``(src_block, src_offset, dst_block, dst_offset, length, count,
    src_stride, dst_stride)`` applied to one tensor (``src`` and ``dst``
    indexed by block first): each of a row's ``count`` pieces inside one
    block on both sides, no byte written twice."""
    s = src.reshape(src.shape[0], -1).view(np.uint8)
    d = dst.reshape(dst.shape[0], -1).view(np.uint8)
    written = np.zeros(d.shape, dtype=bool)
    assert rows.shape[1] == 8
    for sb, so, db, do, n, count, ss, ds in rows.tolist():
        assert count >= 1 and (count == 1 or (ss >= n and ds >= n)), "pieces of a row overlap"
        for j in range(count):
            a, b = so + j * ss, do + j * ds
            assert a + n <= s.shape[1] and b + n <= d.shape[1], "a range leaves its block"
            assert not written[db, b:b + n].any(), "a byte written twice"
            written[db, b:b + n] = True
            d[db, b:b + n] = s[sb, a:a + n]
