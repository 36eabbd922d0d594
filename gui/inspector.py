"""The inspector: the stack of a selected allocation or finding, the user's own frames first."""
from __future__ import annotations

import html
import re

from PySide6.QtGui import QFont, QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from tracekit.analysis.frames import is_internal, user_first

from .palette import fmt_bytes, fmt_duration_us

METHOD_TEXT = {"tag": "tagged by the recorder", "rule": "by a user rule", "inferred": "inferred"}
HINT = "Select an allocation or a finding to see where it was made."


def format_frames(frames) -> list[str]:
    """`file.py:line  in name` and the full path under it; user frames first, torch and library internals after."""
    ordered = user_first(frames)
    if not ordered:
        return ["  (no stack recorded for this entry)"]
    lines, shown_sep = [], False
    for f in ordered:
        if is_internal(f.get("filename", ""), f.get("name", ""), f.get("line")) and not shown_sep:
            lines.append("  ── torch / library internals ──")
            shown_sep = True
        short = re.split(r"[/\\]", f["filename"])[-1]
        lines.append(f"  {short}:{f['line']}  in {f['name']}")
        if short != f["filename"]:
            lines.append(f"      {f['filename']}")
    return lines


class Inspector(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.title = QLabel(HINT)
        self.title.setWordWrap(True)
        self.copy_button = QPushButton("Copy")
        self.copy_button.setToolTip("Copy the details and stack to the clipboard")
        self.copy_button.clicked.connect(self.copy)
        self.text = QPlainTextEdit(readOnly=True)
        self.text.setLineWrapMode(QPlainTextEdit.NoWrap)
        mono = QFont("DejaVu Sans Mono")
        mono.setStyleHint(QFont.Monospace)
        mono.setPointSize(9)
        self.text.setFont(mono)
        head = QHBoxLayout()
        head.addWidget(self.title, 1)
        head.addWidget(self.copy_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(head)
        layout.addWidget(self.text, 1)

    def clear(self):
        self.title.setText(HINT)
        self.text.setPlainText("")

    def copy(self):
        QGuiApplication.clipboard().setText(f"{self.title.text()}\n{self.text.toPlainText()}")

    def show_allocation(self, doc, device, row, category=None, method=None):
        al = doc.replays[device].allocations
        why = doc.reason(device, row)
        a, f = int(al.alloc_index[row]), int(al.free_index[row])
        cat = category.replace("_", " ") + (f" ({METHOD_TEXT.get(method, method)})" if method else "")
        self.title.setText(f"<b>{fmt_bytes(al.size[row])}</b> · {cat} · address 0x{int(al.addr[row]):x}")
        lines = [f"what       {why}",
                 f"size       {int(al.size[row]):,} bytes",
                 f"allocated  {self._when(doc, device, a, 'before the trace began')}",
                 f"freed      {self._when(doc, device, f, 'still live at the end of the trace')}"]
        if a >= 0 and f >= 0 and doc.has_time(device):
            lines.append(f"lifetime   {fmt_duration_us((doc.x_of(device, f) - doc.x_of(device, a)) * 1e6)}"
                         f" ({f - a:,} entries)")
        elif a >= 0 and f >= 0:
            lines.append(f"lifetime   {f - a:,} entries")
        made, module = doc.allocation_origin(device, row)  # forward origin and module (issue 11)
        if made or module:
            lines.append(f"made in    {made or 'forward'}" + (f" · module {module}" if module else ""))
        lib_strings, lib_ids = doc.library_table(device)  # the third-party line and the module (issue 22)
        if lib_strings[lib_ids[row]]:
            lines.append(f"library    {lib_strings[lib_ids[row]]}  (found from {doc.library_how(device, row)})")
        mod_strings, mod_ids = doc.module_table(device)
        if not module and mod_strings[mod_ids[row]]:
            lines.append(f"module     {mod_strings[mod_ids[row]]}  ({doc.module_how(device, row)})")
        lines += ["", "Allocated at (innermost first, your code first):"]
        lines += format_frames(doc.allocation_frames(device, row))
        if al.free_stack_id[row] >= 0:
            lines += ["", "Freed at:"] + format_frames(doc.trace.stack(int(al.free_stack_id[row])))
        self.text.setPlainText("\n".join(lines))

    def show_finding(self, finding):
        kind = finding.get("kind", "")
        size = f" · {fmt_bytes(finding['bytes'])}" if finding.get("bytes") is not None else ""
        self.title.setText(f"<b>{kind.upper()}</b>{size} — {html.escape(finding.get('summary', ''))}")
        lines = []
        if finding.get("index") is not None:
            lines.append(f"at trace entry {finding['index']:,}")
        frames = finding.get("frames") or []
        if frames:
            lines += ["", "Stack (your code first):"] + format_frames(frames)
        for s in (finding.get("top_stacks") or [])[1:]:
            if isinstance(s, dict) and s.get("frames"):
                lines += ["", f"{fmt_bytes(s.get('bytes'))} in {s.get('count', '?')} allocations from "
                              f"{s.get('where') or ''}:"]
                lines += format_frames(s["frames"])[:6]
        self.text.setPlainText("\n".join(lines))

    @staticmethod
    def _when(doc, device, index, missing):
        if index < 0:
            return missing
        if doc.has_time(device):
            return f"at entry {index:,} ({doc.x_of(device, index):.6f} s)"
        return f"at entry {index:,}"
