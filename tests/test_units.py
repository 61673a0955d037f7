"""Byte counts as printed in lines and figure labels (course_lib/units.py)."""

from course_lib.units import binary_bytes, decimal_bytes, readable_number, unit_for


def test_binary_units_for_what_programs_allocate_and_send():
    assert [binary_bytes(n) for n in (0, 1023, 1024, 4 * 2**20, 3 * 2**30)] == ["0 B", "1023 B", "1 KiB", "4 MiB", "3 GiB"]
    assert binary_bytes(2120, significant=3) == "2.07 KiB"


def test_decimal_units_for_memory_as_sold():
    assert [decimal_bytes(n) for n in (999, 1000, 80e9, 2.5e12)] == ["999 B", "1 kB", "80 GB", "2.5 TB"]
    assert decimal_bytes(13_477_000_000, significant=4) == "13.48 GB"


def test_unit_for_an_axis_or_a_column():
    assert unit_for(3 * 2**20) == ("MiB", 2**20)
    assert unit_for(1.5 * 2**20, min_multiple=2) == ("KiB", 2**10)  # two units at least, for readable ticks
    assert unit_for(100) == ("B", 1)
    assert unit_for(3e9, decimal=True, units=("GB", "MB")) == ("GB", 1e9)
    assert unit_for(2e12, decimal=True, units=("GB", "MB")) == ("GB", 1e9)  # TB not among the units
    assert unit_for(5e3, decimal=True, units=("GB", "MB")) == ("MB", 1e6)  # below them all: the smallest


def test_numbers_never_print_in_exponent_notation():
    assert [readable_number(x) for x in (1120.4, 36.75, 12_345, 0.000123, 2.50, 999.96)] == [
        "1120", "36.8", "12,300", "0.000123", "2.5", "1000"]
    assert f"{1120.4:.3g}" == "1.12e+03"  # what the memory explorer's bar labels used to read
    assert binary_bytes(1023 * 2**10 + 600, significant=3) == "1020 KiB"  # :.3g gave "1.02e+03 KiB"
    assert decimal_bytes(1.5e15) == "1500 TB"
