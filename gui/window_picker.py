"""The open dialog's window picker: after a big file is chosen, what a quick first pass knows about it
(tracekit.analysis.survey) and a choice of how much of it to open: the whole file, an entry range, the last N
seconds, or iterations a..b (a tracekit.analysis.window.Window)."""
from __future__ import annotations

import html

from PySide6.QtWidgets import (QButtonGroup, QDialog, QDialogButtonBox, QDoubleSpinBox, QGridLayout, QLabel,
                               QRadioButton, QSpinBox, QVBoxLayout)

from tracekit.analysis.window import Window
from tracekit.analysis.survey import Survey

BIG_BYTES = 200 * 2**20  # files this large (or with this many entries) get the picker before they open
BIG_ENTRIES = 2_000_000
MAX_SPIN = 2**31 - 1


def is_big(s: Survey) -> bool:
    return s.file_bytes > BIG_BYTES or (s.entries or 0) > BIG_ENTRIES


class WindowPicker(QDialog):
    """Pick a window of the surveyed file. `window()` is what was chosen (None: the whole file)."""

    def __init__(self, survey: Survey, parent=None):
        super().__init__(parent)
        self.survey = survey
        self.setWindowTitle("Open a window of a big file")
        layout = QVBoxLayout(self)
        first, *rest = survey.lines()
        facts = QLabel(f"<b>{html.escape(first)}</b><br>" + "<br>".join(html.escape(line) for line in rest))
        facts.setObjectName("facts")
        facts.setWordWrap(True)
        layout.addWidget(facts)
        layout.addWidget(QLabel("Open:"))
        grid = QGridLayout()
        grid.setColumnStretch(4, 1)
        layout.addLayout(grid)
        self.group = QButtonGroup(self)
        n = survey.entries

        self.whole = self._choice(grid, 0, "the whole file" + (f" ({n:,} entries)" if survey.exact else ""))
        self.entries = self._choice(grid, 1, "entries from")
        self.first, self.last = QSpinBox(), QSpinBox()
        top = max((n or 1) - 1, 0) if survey.exact else MAX_SPIN
        for box in (self.first, self.last):
            box.setRange(0, top)
            box.setGroupSeparatorShown(True)
        self.last.setValue(min(top, max((n or 0) - 1, 0)) if survey.exact else min(top, 999_999))
        self.first.setValue(max(self.last.value() - 999_999, 0) if survey.exact else 0)
        grid.addWidget(self.first, 1, 1)
        grid.addWidget(QLabel("to"), 1, 2)
        grid.addWidget(self.last, 1, 3)
        grid.addWidget(QLabel("(numbered from 0 on each device)"), 1, 4)

        self.recent = self._choice(grid, 2, "the last")
        self.seconds = QDoubleSpinBox()
        self.seconds.setRange(0.001, 1e7)
        self.seconds.setDecimals(3)
        self.seconds.setSuffix(" s")
        span = survey.seconds
        self.seconds.setValue(min(10.0, span) if span else 10.0)
        grid.addWidget(self.seconds, 2, 1)
        grid.addWidget(QLabel(f"of {span:.3f} s" if span else ""), 2, 2, 1, 3)
        if survey.exact and span is None:
            self._off(self.recent, self.seconds, "the file has no time stamps")

        self.iters = self._choice(grid, 3, "iterations")
        self.it_first, self.it_last = QSpinBox(), QSpinBox()
        known = survey.iterations
        for box in (self.it_first, self.it_last):
            box.setRange(*(known or (0, 100_000)))
        if known:
            self.it_first.setValue(max(known[0], known[1] - 2))
            self.it_last.setValue(known[1])
        grid.addWidget(self.it_first, 3, 1)
        grid.addWidget(QLabel("to"), 3, 2)
        grid.addWidget(self.it_last, 3, 3)
        grid.addWidget(QLabel(f"(of {known[0]}..{known[1]})" if known else ""), 3, 4)
        if survey.iterations_known and known is None:
            self._off(self.iters, self.it_first, "no iterations are known in this file")
            self.it_last.setEnabled(False)

        self.problem = QLabel("")
        self.problem.setStyleSheet("color: #b00020")
        layout.addWidget(self.problem)
        buttons = QDialogButtonBox(QDialogButtonBox.Open | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self._accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.open_button = buttons.button(QDialogButtonBox.Open)
        (self.recent if span else self.entries if survey.exact else self.whole).setChecked(True)
        for box in (self.first, self.last, self.seconds, self.it_first, self.it_last):
            box.valueChanged.connect(self._check)
        self.group.buttonToggled.connect(self._check)
        self._check()

    def _choice(self, grid, row, text):
        button = QRadioButton(text)
        self.group.addButton(button)
        grid.addWidget(button, row, 0)
        return button

    @staticmethod
    def _off(button, box, why):
        button.setEnabled(False)
        box.setEnabled(False)
        button.setToolTip(why)
        box.setToolTip(why)

    def window(self) -> Window | None:
        """The chosen window (None: the whole file)."""
        if self.entries.isChecked():
            return Window(first=self.first.value(), last=self.last.value())
        if self.recent.isChecked():
            return Window(last_us=round(self.seconds.value() * 1e6))
        if self.iters.isChecked():
            return Window(iterations=(self.it_first.value(), self.it_last.value()))
        return None

    def _why_not(self) -> str:
        if self.entries.isChecked() and self.last.value() < self.first.value():
            return "the last entry is before the first"
        if self.iters.isChecked() and self.it_last.value() < self.it_first.value():
            return "the last iteration is before the first"
        return ""

    def _check(self, *_):
        why = self._why_not()
        self.problem.setText(why)
        self.open_button.setEnabled(not why)

    def _accept(self):
        if not self._why_not():
            self.accept()


def pick_window(survey: Survey, parent=None):
    """Ask which window of a surveyed file to open: (accepted, window or None for the whole file)."""
    dialog = WindowPicker(survey, parent)
    accepted = dialog.exec() == QDialog.Accepted
    return accepted, dialog.window() if accepted else None
