"""Drawing, in the kernel, what the ranks measured: the only place matplotlib and ipywidgets are used.

Each `show_*` prints the numbers it draws and returns them with the figure, so
tests assert on what the learner sees. `figures` holds the shared pieces
(pyplot-free figures, rank colours); `widgets` the interactive explorers, each
with a static PNG and text fallback.
"""
