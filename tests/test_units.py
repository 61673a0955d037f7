"""Byte counts as printed in lines and figure labels (course_lib/units.py)."""

from course_lib.units import binary_bytes, decimal_bytes


def test_binary_units_for_what_programs_allocate_and_send():
    assert [binary_bytes(n) for n in (0, 1023, 1024, 4 * 2**20, 3 * 2**30)] == ["0 B", "1023 B", "1 KiB", "4 MiB", "3 GiB"]
    assert binary_bytes(2120, significant=3) == "2.07 KiB"


def test_decimal_units_for_memory_as_sold():
    assert [decimal_bytes(n) for n in (999, 1000, 80e9, 2.5e12)] == ["999 B", "1 kB", "80 GB", "2.5 TB"]
    assert decimal_bytes(13_477_000_000, significant=4) == "13.48 GB"
