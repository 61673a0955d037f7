"""The workshop kit's room: is this machine ready for the course, and what to do if not.

    python -m course_lib.doctor        # pre-flight: one line per check, a verdict, exit 1 on a blocking problem

`checks` runs the pre-flight checks (lesson 00's last cell calls it), `machine`
describes the machine (`cl.describe_machine()`), `lab_settings` turns on
JupyterLab's saving of widget state (`make install`). Nothing else in
course_lib imports this room; it may import the launcher (for its 2-rank job).

This module imports nothing, so `python -m course_lib.doctor.lab_settings` runs
its module once, as `__main__`.
"""
