"""Launch-grid sizing shared by the row kernels (Triton ``triton_scoring`` and CUDA ``cuda_scoring``): pure
functions of ints, so a grid depends on shapes and the SM count only."""
from __future__ import annotations

import functools


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1024)  # on every eager launch; a pure function of ints
def row_tiles(rows: int, width: int, block_n: int, tiles: int, slots: int, min_tiles: int = 4,
              overhead: float = 1.5) -> int:
    """Tiles per program of a row-kernel grid ``rows x ceil(tiles per row / t)``, ``min(tiles, min_tiles) <= t <=
    tiles``: the ``t`` minimizing (waves of ``slots`` programs) x (``t`` + ``overhead``), the fixed per-program cost
    (queries, ids, pipeline fill) counted in tiles. A grid only a few waves deep otherwise ends on a partly
    empty wave: 128 sparse decode rows of 128 tiles in 16-tile programs are 1024 programs on 396 slots, 2.6
    waves run as 3; 22-tile programs make 768 (2 waves)."""
    tr = max(1, cdiv(width, block_n))
    best_t, best_cost = tiles, None
    for t in range(min(tiles, min_tiles), tiles + 1):
        cost = cdiv(rows * cdiv(tr, t), slots) * (t + overhead)
        if best_cost is None or cost < best_cost:
            best_t, best_cost = t, cost
    return best_t
