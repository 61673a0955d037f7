"""Lesson 02's predictions (see course_lib/predictions/__init__.py)."""

from __future__ import annotations

from .spec import Prediction, Tolerance

__all__ = ["PREDICTIONS"]

PREDICTIONS: dict[str, Prediction] = {}
