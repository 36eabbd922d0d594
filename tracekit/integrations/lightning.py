"""Lightning: `Trainer(..., callbacks=[TracekitCallback("mem.pickle", warmup_steps=1, steps=3)])`.

Records training steps `warmup_steps + 1` to `warmup_steps + steps` (optimizer
steps: with gradient accumulation a step spans several batches) with
the LightningModule and its (first) optimizer known, phases from the
forward (`training_step`, which automatic optimization runs inside
`optimizer.step(closure)`), backward and optimizer step, and logs a
one-line summary once written. An exception in training still writes what was recorded. Each
process of a multi-process run writes its own file (".rankN" before the
suffix, or "{rank}" in the path). Works with `lightning` or
`pytorch_lightning` (neither is a tracekit dependency).
"""
from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]  # the older package, same class

from .steps import StepRecorder


class TracekitCallback(Callback):
    def __init__(self, path="tracekit-lightning.pickle", warmup_steps=1, steps=3, **options):
        """options: backend ("auto", "cuda", "cpu"), stacks, max_entries, activations (see `tracekit.record`)."""
        self.recorder = StepRecorder(path, warmup_steps, steps, log=print, **options)
        self._wrapped = None
        self._global_step = None  # trainer.global_step at the last step boundary

    @property
    def written(self):
        return self.recorder.written

    def on_train_start(self, trainer, pl_module):
        optimizers = getattr(trainer, "optimizers", None) or [None]
        self.recorder.begin(pl_module, optimizers[0], command=["lightning.Trainer"])
        self._global_step = getattr(trainer, "global_step", None)
        # training_step calls submodules, not pl_module's forward: mark the forward where it starts
        original = pl_module.training_step
        recorder = self.recorder

        def training_step(*args, **kwargs):
            recorder.forward_started(pl_module)
            return original(*args, **kwargs)

        pl_module.training_step = training_step
        self._wrapped = pl_module

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # a step is an optimizer step (trainer.global_step counts them): with gradient accumulation, several batches
        step = getattr(trainer, "global_step", None)
        if step is None or step != self._global_step:
            self._global_step = step
            self.recorder.step()

    def on_train_end(self, trainer, pl_module):
        self._unwrap()
        self.recorder.end()

    def on_exception(self, trainer, pl_module, exception):
        self._unwrap()
        self.recorder.end(error=exception)

    def _unwrap(self):
        if self._wrapped is not None:
            self._wrapped.__dict__.pop("training_step", None)  # the class's method again
            self._wrapped = None
