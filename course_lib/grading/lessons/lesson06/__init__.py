"""Lesson 06's exercises: `exercises` (specs, references, judges: the checker's side) and `drivers` (the ranks' side)."""
