"""The tracekit desktop viewer (PySide6 + pyqtgraph).

Only this package imports Qt. It shows what `tracekit.analysis` computes and
computes nothing of its own: files -> tracekit.load -> analysis -> widgets.
Start it with `tracekit view FILE` or `gui.app.main([FILE])`.
"""
