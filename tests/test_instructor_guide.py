"""docs/instructor.md against the README and the doctor: the guide's lesson times are the README's, and its
table of the doctor's checks names every check the doctor makes."""

from __future__ import annotations

import pathlib
import re

from course_lib.doctor import checks

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "instructor.md"
# A lessons-table row: | [`notebooks/NN_x.ipynb`](link) | time | ... (the README's rows go on with a description)
ROW = re.compile(r"^\| \[`((?:notebooks|exercises)/\d\d_[^`]+\.ipynb)`\]\([^)]*\) \| ([^|]+?) \|", re.M)


def times(path: pathlib.Path) -> dict[str, str]:
    rows = ROW.findall(path.read_text())
    found = dict(rows)
    assert len(found) == len(rows), f"{path.name}: a notebook listed twice"
    return found


def test_guide_lists_every_notebook_with_the_readme_time():
    readme, guide = times(ROOT / "README.md"), times(GUIDE)
    assert {f"{n:02d}" for n in range(11)} <= {pathlib.Path(p).name[:2] for p in readme}, "README: lessons 00-10"
    assert set(guide) == set(readme), (f"in the README only: {sorted(set(readme) - set(guide))}; "
                                       f"in the guide only: {sorted(set(guide) - set(readme))}")
    differ = {path: (guide[path], readme[path]) for path in readme if guide[path] != readme[path]}
    assert not differ, f"guide's time against the README's: {differ}"


def test_every_notebook_in_the_repository_is_in_the_guide():
    on_disk = {f"{folder}/{p.name}" for folder in ("notebooks", "exercises")
               for p in (ROOT / folder).glob("[0-9][0-9]_*.ipynb")}
    assert on_disk == set(times(GUIDE))


def test_guide_names_every_doctor_check():
    facts = checks.Facts(python=(3, 11, 0), torch="2.13.0", distributed=True, backends={"gloo": True, "nccl": False},
                         cores=2, packages={name: "1" for name in checks.JUPYTER_PACKAGES}, save_widget_state=True,
                         job="")
    names = {finding.check for finding in checks.judge(facts)}
    assert len(names) >= 10
    table = set(re.findall(r"^\| ([a-z0-9 -]+?) \|", GUIDE.read_text(), re.M))
    assert names <= table, f"doctor checks missing from the guide's table: {sorted(names - table)}"
