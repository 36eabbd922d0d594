"""Real recordings for comparisons: a tiny GPT trained on the CPU with one knob changed.

`record_run(path, batch=8, checkpoint=False, optimizer="adam")` records one
unrecorded warm-up step and two recorded steps with tracekit's recorder and
returns the raw snapshot dict (for independent checks) of the file written.
"""
import torch
from torch.utils.checkpoint import checkpoint as run_checkpointed

import tracekit
from tracekit.io.unpickle import restricted_load
from tracekit.record.toy import TinyGPT, lm_loss, random_batch

VOCAB, D_MODEL, LAYERS, SEQ = 512, 64, 2, 64


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks can be recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, checkpoint=False, **kw):
        super().__init__(**kw)
        self.checkpoint = checkpoint

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = run_checkpointed(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return self.head(self.ln(x))


def record_run(path, batch=8, checkpoint=False, optimizer="adam", warmup=1, steps=2, seed=0):
    torch.manual_seed(seed)
    model = CheckpointedGPT(checkpoint, vocab=VOCAB, d_model=D_MODEL, n_layers=LAYERS, n_heads=4, seq=SEQ)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=1e-2))
    gen = torch.Generator().manual_seed(seed + 1)

    def step():
        inputs, targets = random_batch(VOCAB, batch, SEQ, generator=gen)
        lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    written = tracekit.record_steps(step, steps=steps, warmup=warmup, path=str(path), model=model, optimizer=opt,
                                    backend="cpu")  # under a multi-process launch the name gets .rankN
    with open(written, "rb") as f:
        return restricted_load(f)
