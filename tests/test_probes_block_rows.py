"""The attention probe's block-table fields, computed on the used columns only and trimmed in
Python for a few rows, numpy for many: each record names exactly the rows that differ from the
previous record's, trimmed of their trailing zeros (the null block), whatever the used width does
between steps (a long request arriving past the old width, leaving, rows added and dropped)."""

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


def test_used_width_is_the_last_column_holding_a_block():
    rng = np.random.default_rng(1)
    table = _table(_rows(rng, rng.integers(0, 9, 12)))
    table[5, 30] = 7  # a block past a gap of empty columns counts
    assert attention._used_width(table) == 31
    assert attention._used_width(np.zeros((4, 64), np.int32)) == 0
    assert attention._used_width(np.zeros((0, 64), np.int32)) == 0


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
            fields = attention._block_rows(table)
            rows = _trimmed(table)
            if prev is None:
                assert fields == {"block_table": rows, "block_table_since": None, "block_table_rows": None}
            else:
                changed = [i for i, row in enumerate(rows) if i >= len(prev) or row != prev[i]]
                assert fields["block_table_since"] == step - 1
                assert fields["block_table_rows"] == changed, step
                assert fields["block_table"] == [rows[i] for i in changed], step
            prev = rows
    finally:
        R.attn_prev_table, R.worker_step = saved
