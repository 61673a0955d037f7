"""Protect the grader's own files from the code it grades: snapshot, compare, restore.

Learners' functions run as the same OS user as the grader, so they could
overwrite earlier results, the hidden checks or course_lib itself. Before each
submission the grader snapshots those files (contents kept in memory); after
it, anything changed, deleted or added is put back as it was, and the
submission is told so and scores zero. (For stronger isolation run each
submission in its own container, as Gradescope does.)
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["FileGuard"]


class FileGuard:
    """The files under some folders, as they were at `snapshot()`."""

    def __init__(self, folders: list[pathlib.Path]):
        self.folders = [f.resolve() for f in folders if f is not None]
        self.saved: dict[pathlib.Path, bytes] = {}
        self.saved_dirs: set[pathlib.Path] = set()

    def _files(self) -> list[pathlib.Path]:
        found = []
        for folder in self.folders:
            if folder.is_dir():
                found += [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        return found

    def _dirs(self) -> set[pathlib.Path]:
        return {p for folder in self.folders if folder.is_dir() for p in folder.rglob("*")
                if p.is_dir() and "__pycache__" not in p.parts}

    def snapshot(self) -> None:
        self.saved = {path: path.read_bytes() for path in self._files()}
        self.saved_dirs = self._dirs()

    def restore(self) -> list[str]:
        """Put every file back as snapshotted; return what had changed ("changed: path", ...)."""
        changes = []
        now = set(self._files())
        for path in sorted(now - set(self.saved)):
            changes.append(f"added {path}")
            path.unlink()
        for path, content in sorted(self.saved.items()):
            try:
                same = path.read_bytes() == content
            except FileNotFoundError:
                changes.append(f"deleted {path}")
                same = False
            else:
                if not same:
                    changes.append(f"changed {path}")
            if not same:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".restore")
                tmp.write_bytes(content)
                os.replace(tmp, path)
        for folder in sorted(self._dirs() - self.saved_dirs, key=lambda p: len(p.parts), reverse=True):
            changes.append(f"added {folder}/")
            folder.rmdir()  # its files, all added, are gone already; deepest folders first
        return changes
