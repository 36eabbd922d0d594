"""The tracekit desktop viewer (PySide6 + pyqtgraph).

Only this package imports Qt. It shows what `tracekit.analysis` computes and
computes nothing of its own: files -> tracekit.load -> analysis -> widgets.
Installed as `tracekit_gui` (source folder gui/); start it with `tracekit view FILE`
or `python -m tracekit_gui FILE`.
"""
