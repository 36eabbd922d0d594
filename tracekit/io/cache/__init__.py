"""The cache: what tracekit keeps of the files it opened, so the next look at them is fast.

All of it lives in one folder of the user's (folder.py: where it is, the content key of a file
remembered under its fingerprint, JSON results beside an entry, the code stamp that keys results on
tracekit's own code). Beside each opened file's key:

- traces.py   the file's Trace as memory-mapped columns (`.tkc`), with entry checks and LRU eviction;
- reports.py  the `report --json` of the file (per window, rules and estimate options);
- memo.py     the analyses memoised on the trace (`.tkm`), which the viewer restores on a warm open.

Nothing here analyses: the report and the analyses are computed by tracekit.analysis and handed in.
"""
