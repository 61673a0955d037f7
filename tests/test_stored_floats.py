"""Stored outputs show floats only to the digits that survive another CPU or BLAS path.

MKL picks its kernels by CPU and by memory alignment, so the last digits of a float32 result move between
machines and even between processes (`0.6629877686500549` stored, `0.6629875898361206` on another
EPYC). A checked output (nbval compares it) therefore prints about 4 significant digits, tiny differences
as a bound (`< 1e-6`), and `assert_close` in the cell carries the exact check. This fails on any float
printed with more than 6 significant digits outside a cell marked `# NBVAL_IGNORE_OUTPUT`.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STORED = sorted(p for folder in ("notebooks", "solutions") for p in (ROOT / folder).glob("*.ipynb"))
# A decimal number (optionally with an exponent) or an exponent form, not part of a name, path or version.
FLOAT = re.compile(r"(?<![\w.])-?(\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")
MAX_SIGNIFICANT = 6


def significant_digits(number: str) -> int:
    """Digits of the mantissa without its leading zeros: '0.00120' -> 3, '1.2357113361358643' -> 17."""
    return len(re.split(r"[eE]", number)[0].lstrip("-").replace(".", "").lstrip("0"))


def unchecked(cell: dict) -> bool:
    source = "".join(cell["source"])
    tags = cell.get("metadata", {}).get("tags", [])
    return "NBVAL_IGNORE_OUTPUT" in source or "NBVAL_SKIP" in source or "nbval-ignore-output" in tags


def long_floats(path: pathlib.Path) -> list[str]:
    found = []
    code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    for number, cell in enumerate(code):
        if unchecked(cell):
            continue
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
            found += [f"Cell {number}: {m.group(0)}" for m in FLOAT.finditer(text)
                      if significant_digits(m.group(1)) > MAX_SIGNIFICANT]
    return found


def test_significant_digits_are_counted_as_a_reader_would():
    assert [significant_digits(n) for n in ("0.00120", "1.2357113361358643", "3e-08", "436.043", "0.5")] == \
        [3, 17, 1, 6, 1]
    assert [m.group(0) for m in FLOAT.finditer("torch 2.13.0, loss 0.6629875898361206, 1e-06, x1.5")] == \
        ["0.6629875898361206", "1e-06"]


@pytest.mark.parametrize("path", STORED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_checked_output_prints_a_float_beyond_what_survives_another_cpu(path):
    found = long_floats(path)
    assert not found, (f"{len(found)} float(s) with more than {MAX_SIGNIFICANT} significant digits in checked "
                       f"outputs (print about 4, or a bound): {found[:5]}")


def test_wrong_answer_messages_compare_their_numbers_within_a_tolerance_not_as_text():
    """tests/exercise_checks.phrase_in: a checker's message printed on another CPU (-0.0369915 for -0.0369916)
    still holds its phrase; another number, another sign or other words do not."""
    from exercise_checks import phrase_in

    message = "rank 0: the step's element 0 is -0.0369915, expected -0.0168026 (one process)"
    assert phrase_in("is -0.0369916, expected -0.0168026", message)
    assert not phrase_in("is -0.0379916, expected -0.0168026", message)
    assert not phrase_in("is -0.0369916, expected 0.0168026", message)
    assert not phrase_in("rank 1: the step's", message)
