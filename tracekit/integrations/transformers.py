"""Hugging Face Trainer: `Trainer(..., callbacks=[TracekitCallback("mem.pickle", warmup_steps=1, steps=3)])`.

Records training steps `warmup_steps + 1` to `warmup_steps + steps` (the
Trainer's optimizer steps are the iterations; forward, backward and the
optimizer step are the phases), with the Trainer's model and optimizer
known, so parameters, gradients and optimizer state are tagged. The file is
written as soon as the last recorded step ends (or when training ends, if
sooner) and a one-line summary is logged. Under torchrun / accelerate each
process writes its own file (".rankN" added before the suffix, or use
"{rank}" in the path). Needs `transformers` (not a tracekit dependency).
"""
from __future__ import annotations

from transformers import TrainerCallback

from .steps import StepRecorder


class TracekitCallback(TrainerCallback):
    def __init__(self, path="tracekit-trainer.pickle", warmup_steps=1, steps=3, **options):
        """options: backend ("auto", "cuda", "cpu"), stacks, max_entries, activations (see `tracekit.record`)."""
        self.recorder = StepRecorder(path, warmup_steps, steps, log=print, **options)

    @property
    def written(self):
        """The path of the recording, once written."""
        return self.recorder.written

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.recorder.begin(model, optimizer, command=["transformers.Trainer", str(getattr(args, "output_dir", ""))])

    def on_step_end(self, args, state, control, **kwargs):
        self.recorder.step()

    def on_train_end(self, args, state, control, **kwargs):
        self.recorder.end()
