"""Workspace sizing and carving for the end-to-end ops.

An end-to-end op processes its rows in chunks whose logits fit the caller's workspace; the chunk size
is a pure function of static sizes (workspace bytes, width), so a captured graph always replays the
same chunking. Layout of a workspace (uint8, 1-D): ``[rows_chunk, row_stride]`` fp32 logits, then two
int32 ``[rows_chunk]`` scratch vectors (per-row lengths), each region 256-B aligned.
"""
from __future__ import annotations

import torch

ALIGN = 256
DEFAULT_LOGITS_BUDGET = 256 << 20  # bytes of logits per chunk when the caller gives no budget


def _align(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def row_stride(width: int) -> int:
    """fp32 elements per logits row in the workspace (rows start 256-B aligned)."""
    return _align(max(width, 1) * 4) // 4


def _row_bytes(width: int) -> int:
    return row_stride(width) * 4 + 2 * 4


def _fixed_bytes() -> int:
    return 3 * ALIGN


def workspace_bytes(max_rows: int, width: int, logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET) -> int:
    """Bytes of workspace for an end-to-end op over at most ``max_rows`` rows of ``width`` columns.

    ``width``: ``max_context`` for the dense ops, ``num_candidate_blocks * cbs`` for the sparse ones.
    The chunk holds ``min(max_rows, logits_budget_bytes // row bytes)`` rows (at least one).
    """
    if max_rows < 1 or width < 1:
        raise ValueError(f"max_rows, width: expected >= 1, got {max_rows}, {width}")
    rows = max(1, min(max_rows, logits_budget_bytes // (row_stride(width) * 4)))
    return _fixed_bytes() + rows * _row_bytes(width)


def dense_workspace_bytes(max_rows: int, max_context: int, logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET) -> int:
    """Workspace for ``indexer_prefill`` / ``indexer_decode``."""
    return workspace_bytes(max_rows, max_context, logits_budget_bytes)


def sparse_workspace_bytes(max_rows: int, num_candidate_blocks: int, cbs: int,
                           logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET) -> int:
    """Workspace for ``sparse_indexer_prefill`` / ``sparse_indexer_decode``."""
    return workspace_bytes(max_rows, num_candidate_blocks * cbs, logits_budget_bytes)


def rows_per_chunk(nbytes: int, width: int) -> int:
    """How many rows one chunk of a workspace of ``nbytes`` holds (0: too small for one row)."""
    return max(0, (nbytes - _fixed_bytes()) // _row_bytes(width))


def min_workspace_bytes(width: int) -> int:
    return _fixed_bytes() + _row_bytes(width)


def carve(workspace: torch.Tensor, rows: int, width: int):
    """Views of a workspace: logits ``float32 [rows, width]`` (row stride ``row_stride(width)``) and two
    int32 ``[rows]`` vectors."""
    rs = row_stride(width)
    lbytes = _align(rows * rs * 4)
    logits = workspace[: rows * rs * 4].view(torch.float32).view(rows, rs)[:, :width]
    off = lbytes
    a = workspace[off: off + rows * 4].view(torch.int32)
    off = _align(off + rows * 4)
    b = workspace[off: off + rows * 4].view(torch.int32)
    return logits, a, b
