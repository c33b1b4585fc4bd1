"""The attention probe's block-table fields, compared with the previous record's rows (a copy kept
and updated in place) and trimmed row by row for a few rows, with numpy for many: each record names
exactly the rows that differ from the previous record's, trimmed of their trailing zeros (the null
block), whatever the used width does between steps (a long request arriving past the old width,
leaving, rows added and dropped) and with CUDA-graph padding rows (0 on the GPU) coming and going."""

from __future__ import annotations

import numpy as np

from vllm_tour.probes import attention
from vllm_tour.trace.writer import RECORDER as R


def _trimmed(table: np.ndarray) -> list[list[int]]:
    """The plain definition: each row up to its last non-zero block."""
    return [row[: max((i + 1 for i, b in enumerate(row) if b), default=0)] for row in table.tolist()]


def _table(rows: list[list[int]], columns: int = 64) -> np.ndarray:
    table = np.zeros((len(rows), columns), np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table


def _check_fields(fields: dict, rows: list[list[int]], prev: list[list[int]] | None, step: int) -> list[list[int]]:
    """The record's block-table fields name exactly the rows that differ from the previous step's (all of
    them, in full, at the first step); returns this step's rows."""
    if prev is None:
        assert fields == {"block_table": rows, "block_table_since": None, "block_table_rows": None}
    else:
        changed = [i for i, row in enumerate(rows) if i >= len(prev) or row != prev[i]]
        assert fields["block_table_since"] == step - 1
        assert fields["block_table_rows"] == changed, step
        assert fields["block_table"] == [rows[i] for i in changed], step
    return rows


def _rows(rng, lengths) -> list[list[int]]:
    return [list(rng.integers(1, 1000, n)) for n in lengths]


def test_trim_rows_gives_the_plain_trim_for_few_and_many_rows():
    rng = np.random.default_rng(0)
    for num_reqs in (0, 1, attention.FEW_ROWS, attention.FEW_ROWS + 1, 40):
        table = _table(_rows(rng, rng.integers(0, 20, num_reqs)))
        if num_reqs > 1:
            table[1, 0] = 0  # the null block inside a row stays, only trailing ones go
        assert attention._trim_rows(table) == _trimmed(table), num_reqs
        assert attention._trim_rows(table[:, :0]) == [[]] * num_reqs  # no used column at all
        for rows in (list(range(0, num_reqs, 2)), list(range(1, num_reqs, 5))):  # listed rows, few or many
            assert attention._trim_rows(table, rows) == [_trimmed(table)[i] for i in rows], (num_reqs, rows)


def test_trim_rows_cuts_inside_the_last_block_whatever_its_bytes():
    """Row by row, the trim reads a row's bytes: blocks whose low bytes are 0 (256, 65536) and wide int64
    tables are cut after their last non-zero block all the same."""
    rng = np.random.default_rng(3)
    for dtype in (np.int32, np.int64):
        rows = [[256, 0, 65536], [7], [], [1 << 24, 512, 0, 0, 3], list(rng.integers(1, 1 << 30, 200))]
        table = _table(rows, columns=256).astype(dtype)
        assert attention._trim_rows(table, list(range(len(rows)))) == _trimmed(table)
        assert attention._trim_rows(table) == _trimmed(table)


def test_block_rows_name_exactly_the_changed_rows_as_the_width_grows_and_shrinks():
    rng = np.random.default_rng(2)
    rows = _rows(rng, rng.integers(1, 5, 10))
    steps = []
    for step in range(30):
        for row in rows:
            if rng.random() < 0.2:
                row.append(int(rng.integers(1, 1000)))  # a request crossing a block boundary
        if step == 8:
            rows[3] += [7] * 40  # one request grows far past the width the others use
        if step == 13:  # ... and its row is refilled with a prefix of it (a prefix-cache hit) as wide as the
            rows[3] = rows[3][: max(len(row) for i, row in enumerate(rows) if i != 3)]  # others: it differs past them only
        if step == 15:
            rows.pop(3)  # a request leaves: the rows after it move up
        if step == 20:
            rows += _rows(rng, [2, 60])  # rows added, one wider than every other
        if step == 25:
            rows = rows[:4]  # rows dropped
        steps.append(_table(rows))
    saved = R.attn_prev_table, R.worker_step
    try:
        R.attn_prev_table, prev = None, None
        for step, table in enumerate(steps, 1):
            R.worker_step = step
            prev = _check_fields(attention._block_rows(table), _trimmed(table), prev, step)
    finally:
        R.attn_prev_table, R.worker_step = saved


def test_block_rows_with_padding_rows_name_exactly_the_changed_rows():
    """A CUDA graph's padding rows are passed as a count (they are 0 on the GPU, stale on the host): the
    record is the one the padded table would give, as the batch and its padding grow and shrink."""
    rng = np.random.default_rng(4)
    rows = _rows(rng, rng.integers(1, 6, 12))
    saved = R.attn_prev_table, R.worker_step
    try:
        R.attn_prev_table, prev = None, None
        for step in range(1, 40):
            for row in rows:
                if rng.random() < 0.3:
                    row.append(int(rng.integers(1, 1000)))
            if step in (6, 20):
                rows = rows[: len(rows) - 5]  # requests finish: the graph pads the batch up to its size
            if step in (12, 30):
                rows += _rows(rng, [3, 1, 4])  # requests arrive on rows that were padding
            padding = int(rng.integers(0, 6)) if step % 3 else 0
            real = _table(rows)
            stale = np.vstack([real, rng.integers(1, 1000, (padding, real.shape[1])).astype(real.dtype)])
            R.worker_step = step
            fields = attention._block_rows(stale[: len(rows)], padding)  # only the batch's rows are read
            prev = _check_fields(fields, _trimmed(real) + [[]] * padding, prev, step)
    finally:
        R.attn_prev_table, R.worker_step = saved
