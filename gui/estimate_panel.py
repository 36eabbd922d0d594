"""The estimate panel: presets and knobs, a stacked bar by category that follows them, measured beside it.

All numbers come from tracekit.analysis.estimate (the same functions as
`tracekit estimate` and the report's predicted vs measured); this module
only lays them out.
"""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QComboBox, QFormLayout, QHBoxLayout, QLabel, QSpinBox, QVBoxLayout, QWidget)

from tracekit.analysis.categories import CATEGORIES
from tracekit.analysis.estimate import Setup, estimate, load_shape, preset_names
from tracekit.analysis.estimate.memory import ATTENTION, CHECKPOINTING, OPTIMIZERS, PRECISIONS, QUANT
from tracekit.analysis.estimate.shapes import ModelShape
from tracekit.errors import TracekitError

from .palette import category_color, fmt_bytes

RECORDED = "the recorded model"


def _combo(items, current):
    box = QComboBox()
    box.addItems(list(items))
    box.setCurrentText(current)
    return box


def _spin(lo, hi, value, step=1):
    box = QSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setValue(value)
    box.setKeyboardTracking(False)
    return box


class EstimatePanel(QWidget):
    """Knobs on the left, bars on the right: predicted (and measured, for an open recording)."""

    def __init__(self, trace=None, device=None, parent=None):
        super().__init__(parent)
        self.setWindowTitle("tracekit · estimate")
        self.recorded_shape, self.measured = None, None
        setup = Setup(precision="bf16", optimizer="adamw", batch=1, seq=2048, attention="flash")
        if trace is not None:
            from tracekit.analysis.estimate.measured import measured_max, recorded_setup

            self.recorded_shape, rsetup, _ = recorded_setup(trace)
            setup = rsetup or setup
            device = trace.devices[0] if device is None and trace.devices else device
            if device is not None:
                self.measured = measured_max(trace, device)
        models = ([RECORDED] if self.recorded_shape is not None else []) + preset_names()
        self.model = _combo(models, RECORDED if self.recorded_shape is not None else "llama-3-8b")
        self.layers = _spin(0, 1000, 0)
        self.layers.setSpecialValueText("as configured")
        self.mode = _combo(("train", "inference"), setup.mode)
        self.precision = _combo(PRECISIONS, setup.precision)
        self.optimizer = _combo(OPTIMIZERS, setup.optimizer)
        self.quant = _combo(QUANT, setup.quant)
        self.lora = _spin(0, 1024, setup.lora_rank)
        self.batch = _spin(1, 65536, setup.batch)
        self.seq = _spin(0, 1 << 20, setup.seq, 128)
        self.checkpointing = _combo(CHECKPOINTING, setup.checkpointing)
        self.attention = _combo(ATTENTION, setup.attention)
        self.zero = _spin(0, 3, setup.zero)
        self.dp = _spin(1, 65536, setup.dp)
        form = QFormLayout()
        for label, w in (("Model", self.model), ("Layers", self.layers), ("Mode", self.mode),
                         ("Precision", self.precision), ("Optimizer", self.optimizer), ("Weights", self.quant),
                         ("LoRA rank", self.lora), ("Micro-batch", self.batch), ("Sequence", self.seq),
                         ("Checkpointing", self.checkpointing), ("Attention", self.attention),
                         ("ZeRO stage", self.zero), ("Data parallel", self.dp)):
            form.addRow(label, w)
            signal = w.currentTextChanged if isinstance(w, QComboBox) else w.valueChanged
            signal.connect(self.update_estimate)
        self.plot = pg.PlotWidget(background="w")
        self.plot.setMouseEnabled(False, False)
        self.plot.hideButtons()
        self.plot.getAxis("left").enableAutoSIPrefix(False)
        self.plot.addLegend(offset=(-10, 10))
        self.text = QLabel()
        self.text.setTextFormat(Qt.RichText)
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextSelectableByMouse)
        right = QVBoxLayout()
        right.addWidget(self.plot, 1)
        right.addWidget(self.text)
        layout = QHBoxLayout(self)
        left = QWidget()
        left.setLayout(form)
        left.setMaximumWidth(300)
        layout.addWidget(left)
        layout.addLayout(right, 1)
        self.result = None
        self.resize(1000, 560)
        self.update_estimate()

    # -- the model and setup the knobs say ------------------------------------------------------
    def shape(self):
        name = self.model.currentText()
        shape = self.recorded_shape if name == RECORDED else load_shape(name)
        if isinstance(shape, ModelShape) and self.layers.value():
            shape = shape.with_(layers=self.layers.value())
        return shape

    def setup(self) -> Setup:
        has_shape = isinstance(self.shape(), ModelShape)
        self.seq.setEnabled(has_shape)
        return Setup(mode=self.mode.currentText(), precision=self.precision.currentText(),
                     optimizer=self.optimizer.currentText(), quant=self.quant.currentText(),
                     lora_rank=self.lora.value(), batch=self.batch.value(),
                     seq=self.seq.value() if has_shape else 0, checkpointing=self.checkpointing.currentText(),
                     attention=self.attention.currentText(), zero=self.zero.value(), dp=self.dp.value())

    def update_estimate(self, *_):
        try:
            est = estimate(self.shape(), self.setup())
        except TracekitError as e:
            self.text.setText(f"<span style='color:#C00000'>{e}</span>")
            return
        self.result = est
        self._draw(est.per_gpu)

    # -- drawing ---------------------------------------------------------------------------------
    def _draw(self, predicted: dict):
        self.plot.clear()
        bars = [("predicted", predicted)] + ([("measured", self.measured)] if self.measured else [])
        top = max(sum(v.get(c, 0) for c in CATEGORIES) for _, v in bars)
        unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
        self.plot.getAxis("left").setLabel(unit)
        self.bars = {}  # name -> {category: bytes} as drawn (for tests and tooltips)
        for cat in CATEGORIES:
            color = category_color(cat)
            xs, heights, bottoms = [], [], []
            for x, (_, values) in enumerate(bars):
                below = sum(values.get(c, 0) for c in CATEGORIES[:CATEGORIES.index(cat)])
                xs.append(x)
                heights.append(values.get(cat, 0) / scale)
                bottoms.append(below / scale)
                self.bars.setdefault(bars[x][0], {})[cat] = values.get(cat, 0)
            if any(heights):
                self.plot.addItem(pg.BarGraphItem(x=xs, height=heights, y0=bottoms, width=0.6, brush=color,
                                                  pen=pg.mkPen("w"), name=cat.replace("_", " ")))
        self.plot.getAxis("bottom").setTicks([[(x, name) for x, (name, _) in enumerate(bars)]])
        self.plot.setXRange(-0.6, len(bars) - 0.4 + (0.8 if len(bars) == 1 else 0.6))
        self.text.setText(self._table(predicted))

    def _table(self, predicted: dict) -> str:
        head = "<tr><th align=left>category</th><th align=right>predicted</th>"
        if self.measured:
            head += "<th align=right>measured</th><th align=right>difference</th>"
        rows = [head + "</tr>"]
        for cat in CATEGORIES:
            p, m = predicted.get(cat, 0), (self.measured or {}).get(cat, 0)
            if not p and not m:
                continue
            row = (f"<tr><td><span style='color:{category_color(cat)}'>■</span> {cat.replace('_', ' ')}</td>"
                   f"<td align=right>{fmt_bytes(p)}</td>")
            if self.measured:
                row += f"<td align=right>{fmt_bytes(m)}</td><td align=right>{fmt_bytes(m - p)}</td>"
            rows.append(row + "</tr>")
        total = f"<tr><td><b>total</b></td><td align=right><b>{fmt_bytes(predicted['total'])}</b></td>"
        if self.measured:
            measured_total = sum(self.measured.values())
            total += "<td></td><td></td>"
            note = ("<br>measured: each category's largest live bytes in the recording (their sum, "
                    f"{fmt_bytes(measured_total)}, is above the peak when they peak at different times)")
        else:
            note = ""
        est = self.result
        params = f"{est.params:,} parameters, {est.trainable_params:,} trainable" if est else ""
        return (f"{params}<table cellspacing=6>{''.join(rows)}{total}</tr></table>"
                f"<span style='color:#666'>per GPU; not counted: CUDA context, NCCL, allocator rounding{note}</span>")


def show(trace=None, device=None, parent=None) -> EstimatePanel:
    """Open the panel as its own window (for the open recording, if any)."""
    panel = EstimatePanel(trace, device)
    panel.setParent(parent, Qt.Window)
    panel.show()
    return panel
