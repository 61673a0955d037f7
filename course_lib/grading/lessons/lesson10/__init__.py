"""Lesson 10: mixture of experts and expert parallelism."""
