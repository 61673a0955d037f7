"""python -m course_lib.doctor: the pre-flight check (course_lib/doctor/checks.py)."""

import sys

from .checks import main

sys.exit(main())
