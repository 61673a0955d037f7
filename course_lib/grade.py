"""`python -m course_lib.grade SUBMISSIONS... [--hidden DIR] [--out DIR]`: see course_lib/grading/grader.py."""

import sys

from .grading.grader import main

if __name__ == "__main__":
    sys.exit(main())
