"""The notebook view: a stacked-timeline PNG written without a display, and %%tracekit through a real kernel."""
import base64
import re
import struct
import zlib

import numpy as np
import pytest

import tracekit
from tracekit.render.palette import category_color
from tracekit.render.png import TimelinePng, rgb, timeline_pixels

from .conftest import SAMPLES


def decode_png(data: bytes) -> np.ndarray:
    """An independent reader for the PNGs we write (8-bit RGB, filter 0 on every row)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    w = h = None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert (depth, ctype) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_shows_the_categories_at_their_heights():
    rec = tracekit.load(SAMPLES / "gpt_adamw.pickle")
    (d,) = rec.report()["devices"]
    img = decode_png(TimelinePng().render(rec, 0, width=400, height=150))
    assert img.shape == (150, 400, 3)
    pixels, top, names = timeline_pixels(rec, 0, width=400, height=150)
    assert np.array_equal(img, pixels) and top >= d["peak_allocated_bytes"]
    # the tallest column stands at the peak's height, and its colours are the categories at the peak
    filled = (img[:-1, 1:] != 255).any(axis=2)  # inside the axes
    heights = filled.sum(axis=0)
    tallest = int(np.argmax(heights))
    assert abs(heights[tallest] - d["peak_allocated_bytes"] / top * 149) <= 2
    colours = {tuple(c) for c in img[:-1, 1 + tallest]}
    for c, b in d["categories_at_peak"].items():
        if b / top * 149 >= 3:  # a band at least 3 pixels tall is visible
            assert rgb(category_color(c, names)) in colours, c


def test_repr_html_has_the_picture_and_the_report():
    rec = tracekit.load(SAMPLES / "logits_spike.pickle")
    page = rec._repr_html_()
    (src,) = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert decode_png(base64.b64decode(src)).shape[2] == 3
    assert "peak allocated" in page and "at the peak:" in page


def test_magic_options():
    from tracekit.integrations.notebook import parse

    o = parse("--device cpu -o 'my file.pickle' --model m")
    assert (o.device, o.output, o.model) == ("cpu", "my file.pickle", "m")
    with pytest.raises(ValueError, match="usage"):
        parse("--device tpu")


@pytest.mark.slow
def test_cell_magic_in_a_real_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("torch")
    out = tmp_path / "cell.pickle"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext tracekit"),
        nbformat.v4.new_code_cell("import torch\nmodel = torch.nn.Linear(512, 512)\n"
                                  "opt = torch.optim.SGD(model.parameters(), lr=0.1)"),
        nbformat.v4.new_code_cell(f"%%tracekit --device cpu -o {out} --model model --optimizer opt\n"
                                  "for _ in range(3):\n"
                                  "    loss = model(torch.randn(64, 512)).square().sum()\n"
                                  "    loss.backward(); opt.step(); opt.zero_grad()\n"
                                  "print('cell ran')"),
        nbformat.v4.new_code_cell("print(type(_tracekit).__name__, int(_tracekit.allocations()['size'].sum()) > 0)"),
    ]
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                            ).execute()
    outputs = nb.cells[2].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "cell ran" in text and f"recorded to {out}" in text
    (page,) = [o.data["text/html"] for o in outputs if o.output_type == "display_data"]
    (src,) = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    img = decode_png(base64.b64decode(src))
    assert (img != 255).any()
    rec = tracekit.load(out)
    (d,) = rec.report()["devices"]
    assert d["label"] == "cpu" and len(rec.recorder["iterations"]) == 3
    assert d["categories_at_peak"].get("parameter", 0) >= 512 * 512 * 4  # the model's weight, tagged
    from tracekit.units import fmt_bytes

    assert f"peak {fmt_bytes(d['peak_allocated_bytes'])} allocated" in page
    assert "".join(o.get("text", "") for o in nb.cells[3].outputs) == "Recording True\n"


class _Shell:
    """Just what %%tracekit uses of IPython's shell: its namespace, and run_cell's result."""

    def __init__(self):
        self.user_ns = {}

    def run_cell(self, cell):
        class Result:
            success, error_in_exec = True, None

        try:
            exec(cell, self.user_ns)
        except Exception as e:  # IPython shows it and carries on
            Result.success, Result.error_in_exec = False, e
        return Result()


def test_notebook_magic_says_out_of_memory(tmp_path, capsys):
    pytest.importorskip("torch")
    from tracekit.integrations.notebook import run_cell

    cell = ("import torch\nx = torch.ones(256, 256)\nraise torch.cuda.OutOfMemoryError("
            "'CUDA out of memory. Tried to allocate 3.00 GiB.')\n")
    run_cell(_Shell(), f"--device cpu --quiet -o {tmp_path / 'c.pickle'}", cell)
    out = capsys.readouterr().out
    assert "tracekit: out of memory" in out and "Tried to allocate 3.00 GiB" in out
