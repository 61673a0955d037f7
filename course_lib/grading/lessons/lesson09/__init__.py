"""Lesson 09: context parallelism."""
