"""Levers: what each usual technique would save at a recording's peak, computed once for every front end.

The report's advice (advice.py), `tracekit whatif` and the estimate's levers (estimate/batch_fit.py) all
call `levers()`, so the same lever on the same file prints the same bytes everywhere. Each lever is
priced from what the file measured at its peak (the categories, the allocations in the model's
repeated blocks, the attention scores) and from facts read off the file (`file_facts`): the workload
(training, inference, generation), the number of repeated blocks, the attention kernel, whether
checkpointing already runs, the micro-batch. Every lever says what it assumed and where each fact
came from; a lever the file contradicts (flash attention on a run that already uses it, gradient
accumulation on a run without gradients) is not offered.

Savings are at today's peak and do not add up: after one change the peak may move elsewhere.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..model import ALLOC, Trace
from ..units import fmt_bytes

FIXED = ("parameter", "gradient", "optimizer_state", "workspace")
GROWING = ("activation", "input", "temporary", "kv_cache")  # with the micro-batch (decided by category)

# fused attention: PyTorch's kernels (C++ frames), Hugging Face's sdpa / flash integrations, flash-attn, xformers
# (a user's own function named like them is not evidence: it may well be eager)
_SDPA_KERNEL = re.compile(r"_scaled_dot_product_(flash|efficient|cudnn|fused)|_flash_attention|_efficient_attention"
                          r"|cudnn_attention|flash_attn|mem_eff")
_SDPA_FILE = re.compile(r"(transformers[/\\]integrations[/\\](sdpa|flash)_attention|flash_attn[/\\]|xformers[/\\])")
_SDPA_MATH = re.compile(r"_scaled_dot_product_attention_math")
_EAGER = re.compile(r"eager_attention_forward")
_SOFTMAX = re.compile(r"(?<![A-Za-z_])_?softmax(?![A-Za-z_])|(?<![A-Za-z_])SoftmaxBackward")
_CHECKPOINT = re.compile(r"torch[/\\]utils[/\\]checkpoint\.py$")
_WORKSPACE = re.compile(r"workspace", re.I)
_LAYER = re.compile(r"\.(\d+)(\.|$)")
EIGHT_BIT_STATE = 1 - (1 + 4 / 2048) / 4  # fp32 state -> 1 B per value + an fp32 absmax per 2048 (bitsandbytes)


# -- facts read off the file --------------------------------------------------------------------------------
def workload(summary: dict, trace: Trace | None = None) -> tuple[str, str]:
    """("training" | "inference" | "generation", why). The report's own `workload` when it has one."""
    given = summary.get("workload")
    if given in ("training", "inference", "generation"):
        return given, "the report's workload"
    phases = {p["phase"] for p in summary.get("phases") or []}
    cats = {**(summary.get("categories_at_end") or {}), **(summary.get("categories_at_peak") or {})}
    rec = (trace.recorder or {}) if trace is not None else {}
    if "backward" in phases:
        return "training", "a backward pass in the file"
    if cats.get("gradient") or cats.get("optimizer_state"):
        return "training", "gradients or optimizer state in the file"
    if rec.get("optimizer"):
        return "training", "the recorder saw an optimizer"
    if any(r["category"] == "activation" and r["reason"].startswith("tagged by the recorder")
           for r in summary.get("reasons_at_peak") or []):
        return "training", "tensors saved for backward (the recorder's tags)"
    model = rec.get("model") or {}
    if (model.get("trainable_parameters") or 0) > 0 and "forward" in phases and not _no_grad(trace):
        return "training", ("the model has trainable parameters and its forward pass builds an autograd graph "
                            "(no torch.no_grad in the stacks); it ended before a backward pass")
    if cats.get("kv_cache") or summary.get("kv_cache"):
        return "generation", "a KV cache and no backward pass"
    return "inference", "no backward pass, gradients or optimizer state"


def _no_grad(trace: Trace | None) -> bool:
    """Some stack runs under torch.no_grad / inference_mode (a decorated function: grad_mode.py)."""
    if trace is None or not len(trace.stacks):
        return False
    from .phases import F_NO_GRAD, stack_flags

    return bool((stack_flags(trace) & F_NO_GRAD).any())


def forward_sequence(trace: Trace, device: int):
    """(rows of the alloc entries of one forward pass in the device's trace, their stack ids); None without phases.
    The forward of the last iteration that has one (warm-up allocations are behind it); in a generation, which
    has no forward phase, its prefill (the first model call, over the whole prompt)."""
    from .phases import FORWARD, PREFILL, phases

    ph = phases(trace)[device]
    if ph.source == "none" or not ph.n:
        return None
    ev = trace.events
    sl = ev.device_slice(device)
    fwd = np.flatnonzero((ph.phase == FORWARD) & (ev.action[sl] == ALLOC))
    if not len(fwd):
        fwd = np.flatnonzero((ph.phase == PREFILL) & (ev.action[sl] == ALLOC))
    if not len(fwd):
        return None
    runs = ph.runs()[fwd]
    best = fwd[runs == runs[0]]
    for _, lo, hi in ph.iterations()[::-1]:
        m = (fwd >= lo) & (fwd <= hi)
        if m.sum() >= 2:
            r = runs[m]
            best = fwd[m][r == r[0]]  # the iteration's first forward run
            break
    return best, ev.stack_id[sl][best]


def repeated_blocks(trace: Trace, device: int) -> dict:
    """How many repeated blocks the model runs in one forward pass, counted from the file.

    From the stacks: the forward pass's allocations under one frame (the loop that calls the blocks, or a
    block's own forward) repeat exactly, N times in a row; the frame whose allocations repeat that way and
    cover most of the pass names the blocks. Else from the recorder's model summary (its longest
    nn.ModuleList). {"count", "source", "frame", "stacks" (stack ids under that frame), "first_sizes"
    (the size of each block's first allocation: about the block's input)}."""
    found: dict
    found = {"count": None, "source": None, "frame": None, "stacks": frozenset(), "first_sizes": []}
    seq = forward_sequence(trace, device)
    if seq is not None and len(seq[1]) >= 2:
        rows, sids = seq
        uniq = np.unique(sids[sids >= 0])
        frames_of = {int(s): set(trace.stacks.frames_of(int(s)).tolist()) for s in uniq}
        python = {f for fs in frames_of.values() for f in fs
                  if trace.strings[int(trace.frames.filename[f])].endswith(".py")}
        got = _periodic(rows, sids, frames_of, python)
        # a loop around the blocks (generation's decoding steps) repeats too: look inside one period for the blocks
        while got is not None:
            crows, csids = got["collapsed"]
            inner = _periodic(crows[:got["period"]], csids[:got["period"]], frames_of, python)
            if inner is None or len(inner["collapsed"][1]) < 0.5 * got["period"]:
                break
            got = inner
        if got is not None:
            fr = trace.frame(got["frame"])
            ev = trace.events
            sl = ev.device_slice(device)
            blocks, period = got["blocks"], got["period"]
            found.update(count=int(blocks), frame=fr,
                         source=f"the stacks: one forward pass runs the same sequence of {period} allocation sites "
                                f"{blocks} times in a row under {_short(fr)}",
                         stacks=frozenset(int(s) for s in np.unique(got["sids"]).tolist()),
                         first_sizes=[int(x) for x in ev.size[sl][got["firsts"]].tolist()])
    if found["count"] is None:  # the forward's sites do not repeat exactly (a layer that makes one more
        # allocation): the module tree from the stacks' forward frames numbers the layers (analysis/modtree.py)
        layers = _stack_layers(trace, device)
        if layers is not None:
            found.update(count=layers[0], source=f"the stacks' forward frames: {layers[0]} numbered instances of "
                                                 f"{layers[1]} (the module tree, analysis/modtree.py)")
    rec_blocks = ((trace.recorder or {}).get("model") or {}).get("repeated_blocks")
    if isinstance(rec_blocks, int) and rec_blocks >= 2:
        if found["count"] is None:
            found.update(count=rec_blocks, source="the recorder's model summary (its longest nn.ModuleList)")
        elif found["count"] != rec_blocks:
            found["source"] += f" (the recorder's model summary says {rec_blocks}: the stacks win)"
    return found


_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _stack_layers(trace: Trace, device: int):
    """(count, "model.layers (Qwen2DecoderLayer)") of the numbered module with the most instances among the
    modules named from the stacks; None when no module is numbered (or the file has module tags of its own)."""
    if trace.events.module.any():
        return None
    from .modtree import allocation_modules

    am = allocation_modules(trace, device)
    seen: dict = {}
    for k, name in enumerate(am.names.tolist()):
        m = _NUMBERED.match(name or "")
        if m:
            seen.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not seen:
        return None
    prefix, idx = max(seen.items(), key=lambda kv: len(kv[1]))
    if len(idx) < 2:
        return None
    return len(idx), prefix


def _stack_layer_rows(trace: Trace, device: int, n: int) -> np.ndarray | None:
    """Allocations whose module (named from the stacks) is inside a numbered layer."""
    if trace.events.module.any():
        return None
    from .modtree import allocation_modules

    am = allocation_modules(trace, device)
    if len(am.module) != n:
        return None
    numbered = np.array([bool(_NUMBERED.match(x or "")) for x in am.names.tolist()], bool)
    return numbered[am.module]


def _periodic(rows, sids, frames_of, python) -> dict | None:
    """The Python frame whose allocations in `sids` repeat N >= 2 times in a row and cover the most of them
    (at least a quarter); None when none does."""
    counts: dict = {}
    for s in sids[sids >= 0].tolist():
        for f in frames_of[s]:
            if f in python:
                counts[f] = counts.get(f, 0) + 1
    best = None
    uniq, inv = np.unique(sids, return_inverse=True)
    for f, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if n < max(2, len(sids) / 4) or (best is not None and n <= len(best["sids"])):
            continue
        has = np.array([s >= 0 and f in frames_of[s] for s in uniq.tolist()], bool)
        under = has[inv]
        sub, sub_rows = sids[under], rows[under]
        # runs of one site collapse to one step: a block that makes one allocation more than the others (a
        # workspace made lazily the first time) still repeats the same sequence of sites
        starts = np.flatnonzero(np.diff(sub, prepend=-2) != 0)
        blocks = _repeats(sub[starts])
        if blocks >= 2 and len(starts) // blocks >= 2:
            per = len(starts) // blocks
            firsts = sub_rows[starts[::per][:blocks]]
            best = {"frame": f, "blocks": blocks, "period": per, "rows": sub_rows, "sids": sub, "firsts": firsts,
                    "collapsed": (sub_rows[starts], sub[starts])}
    return best


def _repeats(sub: np.ndarray) -> int:
    """The largest N such that `sub` is one run of allocations repeated N times (1 when it is not periodic)."""
    n = len(sub)
    for blocks in range(n, 1, -1):
        if n % blocks:
            continue
        period = n // blocks
        if np.array_equal(sub.reshape(blocks, period), np.broadcast_to(sub[:period], (blocks, period))):
            return blocks
    return 1


def _short(frame: dict) -> str:
    from .frames import short_path

    return f"{short_path(frame['filename'])}:{frame['line']} in {frame['name']}"


def attention_kind(trace: Trace, blocks: dict | None = None) -> dict:
    """{"kind": "flash" | "eager" | None, "source", "softmax_stacks"}: fused kernels (SDPA flash / memory-efficient,
    flash-attn, xformers) in the stacks, or an eager softmax of the scores (Hugging Face's eager_attention_forward,
    or a softmax inside the repeated blocks); None when the stacks show neither."""
    names = trace.strings
    fnames = trace.frames.name
    files = trace.frames.filename
    sdpa, math, eager, softmax = set(), set(), set(), set()
    for i in range(len(fnames)):
        name = names[int(fnames[i])].split("(")[0]
        cpp = "::" in name or not names[int(files[i])].endswith(".py")
        if _SDPA_MATH.search(name):
            math.add(i)
        elif (cpp and _SDPA_KERNEL.search(name)) or _SDPA_FILE.search(names[int(files[i])]):
            sdpa.add(i)
        elif _EAGER.search(name):
            eager.add(i)
        elif _SOFTMAX.search(name):
            softmax.add(i)
    used = _frames_in_stacks(trace)
    sdpa, math, eager, softmax = sdpa & used, math & used, eager & used, softmax & used
    if sdpa:
        return {"kind": "flash", "source": f"fused attention kernels in the stacks ({_names(trace, sdpa)})",
                "softmax_stacks": frozenset()}
    in_blocks = (blocks or {}).get("stacks") or frozenset()
    soft_stacks = _stacks_with(trace, softmax)
    attn_stacks = _stacks_with(trace, eager | softmax | math)
    if eager or math:
        what = _names(trace, eager | math)
        return {"kind": "eager", "source": f"eager attention in the stacks ({what})", "softmax_stacks": soft_stacks,
                "attention_stacks": attn_stacks}
    if softmax and (not in_blocks or soft_stacks & in_blocks):
        where = "inside the repeated blocks" if in_blocks else "(the blocks are not known)"
        soft = soft_stacks & in_blocks if in_blocks else soft_stacks
        return {"kind": "eager", "source": f"a softmax of the scores {where} ({_names(trace, softmax)})",
                "softmax_stacks": soft, "attention_stacks": soft}
    return {"kind": None, "source": "the stacks show no attention kernel", "softmax_stacks": frozenset(),
            "attention_stacks": frozenset()}


def _frames_in_stacks(trace: Trace) -> set:
    return set(np.unique(trace.stacks.frame_ids).tolist()) if len(trace.stacks.frame_ids) else set()


def _stacks_with(trace: Trace, frame_ids: set) -> frozenset:
    if not frame_ids or not len(trace.stacks):
        return frozenset()
    st = trace.stacks
    hit = np.isin(st.frame_ids, np.fromiter(frame_ids, np.int64))
    owner = np.repeat(np.arange(len(st)), np.diff(st.offsets))
    return frozenset(np.unique(owner[hit]).tolist())


def _names(trace: Trace, frame_ids: set, limit=2) -> str:
    got = sorted({_short_name(trace.strings[int(trace.frames.name[i])]) for i in frame_ids})
    return ", ".join(got[:limit]) + (", ..." if len(got) > limit else "")


def _short_name(name: str) -> str:
    """"SoftmaxBackward0" for "torch::autograd::generated::SoftmaxBackward0::apply(...)"."""
    parts = [p for p in name.split("(")[0].split("::") if p and p not in ("apply", "call", "redispatch")]
    return parts[-1] if parts else name[:40]


def checkpointing_in_use(trace: Trace) -> bool:
    files = trace.frames.filename
    used = _frames_in_stacks(trace)
    return any(_CHECKPOINT.search(trace.strings[int(files[i])]) for i in used)


def file_facts(trace: Trace, device: int, summary: dict, shape=None, setup=None, batch=None, rules=None,
               expandable: bool = False) -> dict:
    """What the file says that the levers rest on (see the module's doc); `shape`/`setup` (estimate) only fill
    in what the file does not say. JSON-ready."""
    from .replay import replay

    rep = replay(trace)[device]
    work, work_why = workload(summary, trace)
    blocks = repeated_blocks(trace, device)
    if blocks["count"] is None and shape is not None and getattr(shape, "layers", 0) >= 2:
        blocks.update(count=int(shape.layers), source="the model's config (its layers)")
    attn = attention_kind(trace, blocks)
    rec = trace.recorder or {}
    model = rec.get("model") or {}
    shape_in = model.get("input_shape") or []
    if batch is not None:
        batch_source = "given (--sizes)"
    elif len(shape_in) >= 1 and isinstance(shape_in[0], int):
        batch, batch_source = shape_in[0], "the recorder (the first forward's input shape)"
    elif setup is not None and getattr(setup, "batch", None) and setup.batch > 1:
        batch, batch_source = setup.batch, "given"
    else:
        batch_source = "not in the file"
    seq = shape_in[1] if len(shape_in) >= 2 and isinstance(shape_in[1], int) else (getattr(setup, "seq", 0) or None)
    at_peak = summary.get("categories_at_peak") or {}
    live = rep.allocations.live_at(rep.peak_index) if len(rep.allocations) else np.zeros(0, bool)
    from .categories import categorize

    cats = categorize(trace, rules)[device]
    names = list(cats.names)
    act = names.index("activation")
    sid = rep.allocations.stack_id
    in_blocks = np.isin(sid, np.fromiter(blocks["stacks"], np.int64)) if blocks["stacks"] else np.zeros(len(sid), bool)
    mods = _module_layers(trace, rep)
    if mods is None:
        mods = _stack_layer_rows(trace, device, len(sid))
    if mods is not None:
        in_blocks |= mods
    block_act = int(rep.allocations.size[live & in_blocks & (cats.labels == act)].sum())
    grads = _most_live(rep, cats.labels == names.index("gradient")) if "gradient" in names else 0
    block_source = ("the activations live at the peak that were made inside the repeated blocks"
                    if block_act else "all activations at the peak (the file does not say which are in the blocks)")
    if not block_act:
        block_act = int(at_peak.get("activation", 0))
    width = _bytes_per_parameter(model)
    width_source = "the recorder" if width else None
    if width is None:  # autocast's 16-bit copies of weights (categories.py) say the weights are stored in fp32
        from .categories import REASONS, R

        copies: Any
        copies = np.isin(cats.reason, [R[REASONS[6]], R[REASONS[35]]]) if len(cats.reason) else []
        if np.any(copies):
            width, width_source = 4.0, "fp32: autocast makes 16-bit copies of the weights in this file"
    scores = _scores_at_peak(trace, rep, cats, live, attn, shape, batch, seq)
    opt = (rec.get("optimizer") or {}).get("class") or ""
    trainable = model.get("trainable_parameters")
    lora = bool(model.get("parameters") and trainable is not None and trainable < 0.5 * model["parameters"])
    settings = trace.meta.get("allocator_settings") or {}
    world = (rec.get("settings") or {}).get("world_size")
    reasons = summary.get("reasons_at_peak") or []
    workspace = sum(r["bytes"] for r in reasons if r["category"] == "other" and _WORKSPACE.search(r["reason"]))
    return {
        "device": device, "label": summary.get("label"), "workload": work, "workload_source": work_why,
        "batch": batch, "batch_source": batch_source, "seq": seq,
        "blocks": blocks["count"], "blocks_source": blocks["source"] or "neither the stacks nor the recorder say",
        "block_activation_bytes": block_act, "block_activation_source": block_source,
        "block_input_bytes": _block_input(blocks, shape, batch, seq),
        "attention": attn["kind"], "attention_source": attn["source"],
        "scores_at_peak_bytes": scores[0], "scores_source": scores[1],
        "checkpointing": checkpointing_in_use(trace),
        "optimizer": opt or None, "lora": lora, "bytes_per_parameter": width,
        "bytes_per_parameter_source": width_source,
        "cpu": summary.get("label") == "cpu" or rec.get("backend") == "cpu",
        "expandable_segments": bool(settings.get("expandable_segments")),
        # what expandable segments would save: the allocator replay (two runs of the model: asked for by whatif,
        # whose levers show it; the report's advice never offers it)
        "expandable": None if settings.get("expandable_segments") or not expandable else _expandable(trace, device),
        "world_size": world if isinstance(world, int) and world > 1 else None,
        "workspace_bytes": int(workspace),
        "gradient_bytes": grads,
        "fixed_precision": _precision(model),
        "distributed": summary.get("distributed"),  # what this rank of a sharded / DDP job holds (distributed.py)
    }


def _expandable(trace: Trace, device: int):
    """The allocator replay's saving from expandable segments (allocator/settings_replay.expandable_saving), or None."""
    if (trace.recorder or {}).get("backend") == "cpu":
        return None
    from .allocator.settings_replay import expandable_saving

    return expandable_saving(trace, device)


def _most_live(rep, mask) -> int:
    """The most bytes that the allocations in `mask` hold at once."""
    a = rep.allocations
    sel = np.flatnonzero(mask)
    if not len(sel):
        return 0
    born = np.maximum(a.alloc_index[sel], -1)
    gone = np.where(a.free_index[sel] == -1, np.iinfo(np.int64).max, a.free_index[sel])
    at = np.concatenate([born, gone])
    delta = np.concatenate([a.size[sel], -a.size[sel]])
    order = np.lexsort((delta, at))  # at one entry, a free before an allocation
    return int(max(0, np.cumsum(delta[order]).max()))


def _module_layers(trace: Trace, rep) -> np.ndarray | None:
    """Allocations our recorder made inside a numbered submodule (`layers.3.mlp`): in the repeated blocks."""
    mods = trace.events.module
    if not len(rep.allocations) or not mods.any():
        return None
    sl = rep.events
    idx = rep.allocations.alloc_index
    ok = idx >= 0
    out = np.zeros(len(idx), bool)
    ev = mods[sl]
    if not len(ev):  # a device with segments but no trace entries: nothing was made inside a module
        return out
    names = ev[np.where(ok, idx, 0)]
    layer = {i: bool(_LAYER.search(trace.strings[int(i)])) for i in np.unique(names).tolist() if i}
    out[ok] = [layer.get(int(n), False) for n in names[ok].tolist()]
    return out


def _block_input(blocks, shape, batch, seq) -> dict:
    sizes = blocks.get("first_sizes") or []
    if sizes:
        return {"bytes": int(np.median(sizes)), "source": "the size of the first tensor each block makes (about its "
                                                           "input, e.g. a norm's output)"}
    hidden = getattr(shape, "hidden", 0) if shape is not None else 0
    if hidden and batch and seq:
        return {"bytes": int(batch * seq * shape.hidden * 4),
                "source": f"batch {batch} × seq {seq} × hidden {shape.hidden} × 4 B (fp32 residual stream)"}
    return {"bytes": None, "source": "assumed: a block's input is about 10% of its activations"}


def _scores_at_peak(trace, rep, cats, live, attn, shape, batch, seq) -> tuple[int, str]:
    """Bytes of attention scores (batch × heads × seq², as the eager path materializes them) live at the peak."""
    if attn["kind"] != "eager" or not len(rep.allocations):
        return 0, "no eager attention in the file"
    al = rep.allocations
    sizes = set()
    soft = attn.get("softmax_stacks") or frozenset()
    if soft:
        made = np.isin(al.stack_id, np.fromiter(soft, np.int64))
        if made.any():
            top = int(np.bincount(np.unique(al.size[made], return_inverse=True)[1]).argmax())
            s = int(np.unique(al.size[made])[top])
            sizes = {s, s * 2}  # the scores, and their fp32 softmax in 16-bit runs
    how = "allocations the size of the softmax of the scores"
    if not sizes and shape is not None and batch and seq and getattr(shape, "heads", 0):
        s = batch * shape.heads * seq * seq
        sizes = {2 * s, 4 * s}
        how = f"allocations of batch {batch} × heads {shape.heads} × seq² {seq}² × 2 or 4 B"
    if not sizes:
        return 0, "the size of the scores is not known"
    grow = np.isin(cats.labels, [i for i, n in enumerate(cats.names) if n in ("activation", "temporary")])
    rows = live & grow & np.isin(al.size, np.array(sorted(sizes), np.int64))
    inside = attn.get("attention_stacks") or frozenset()
    if inside:  # made inside the attention (other tensors may have the scores' size: an MLP's hidden state)
        rows &= np.isin(al.stack_id, np.fromiter(inside, np.int64))
        how += " made inside the attention"
    return int(al.size[rows].sum()), f"{how}, live at the peak ({int(rows.sum())} of them)"


def _bytes_per_parameter(model: dict):
    try:
        n, b = int(model.get("parameters") or 0), int(model.get("parameter_bytes") or 0)
    except (TypeError, ValueError):
        return None
    return b / n if n and b else None


def _precision(model: dict) -> str | None:
    dtypes = model.get("dtypes") or {}
    if not dtypes:
        return None
    main = max(dtypes, key=lambda t: dtypes[t])
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(main, main)


def growing_bytes(at_peak: dict, facts: dict | None = None) -> int:
    """Bytes at the peak that grow with the micro-batch: activations, inputs, temporaries, the KV cache."""
    return int(sum(at_peak.get(c, 0) for c in GROWING))


# -- the levers ---------------------------------------------------------------------------------------------
def levers(facts: dict, at_peak: dict, peak: int, fragmentation: int = 0, spikes=(), dp: int | None = None) -> list:
    """Every lever the file allows, largest saving first: [{"technique", "lever", "category", "saves_bytes",
    "assumes", "how", "evidence"}]. `peak`: the device's peak (or the demand of a run that ran out of memory)."""
    out = []
    work = facts["workload"]
    train = work == "training"

    def add(technique, lever, category, saves, assumes, how, evidence):
        if saves > 0:
            out.append({"technique": technique, "lever": lever, "category": category, "saves_bytes": int(saves),
                        "assumes": assumes, "how": how,
                        "evidence": {"rule": evidence, "workload": f"{work} ({facts['workload_source']})"}})

    act = at_peak.get("activation", 0)
    state, grad, param = at_peak.get("optimizer_state", 0), at_peak.get("gradient", 0), at_peak.get("parameter", 0)
    kv = at_peak.get("kv_cache", 0)
    growing = growing_bytes(at_peak, facts)
    batch = facts.get("batch")
    if train and facts.get("blocks") and facts["blocks"] >= 2 and not facts.get("checkpointing"):
        n = facts["blocks"]
        a = min(facts["block_activation_bytes"], act)
        inb = facts["block_input_bytes"]
        keep_inputs = n * inb["bytes"] if inb["bytes"] else 0.1 * a
        saves = a - keep_inputs - a / n
        add("activation checkpointing", f"activation checkpointing of each of the {n} repeated blocks", "activation",
            saves, f"{n} repeated blocks ({facts['blocks_source']}); {fmt_bytes(a)} of activations in them at the peak "
                   f"({facts['block_activation_source']}); checkpointing keeps each block's input "
                   f"({inb['source']}) plus one block recomputed in backward",
            "Wrap each block in torch.utils.checkpoint (costs about one extra forward pass).",
            "activations at the peak × (1 - 1/blocks) - the blocks' inputs")
    if train and growing > 0 and (batch is None or batch >= 2):
        half = batch // 2 if batch else None
        lever = (f"gradient accumulation: micro-batch {half}, accumulate ×2" if half
                 else "halve the micro-batch, double gradient accumulation")
        held = max(0, int(facts.get("gradient_bytes") or 0) - grad)
        add("gradient accumulation", lever, "activation", growing / 2 - held,
            f"what grows with the micro-batch at the peak ({fmt_bytes(growing)}: activations, inputs, temporaries, "
            f"KV cache) halves with it; the micro-batch is "
            f"{str(batch) + ' (' + facts['batch_source'] + ')' if batch else 'even and at least 2 (not in the file)'}; "
            "the effective batch stays the same"
            + (f"; the gradients ({fmt_bytes(held)} more than at today's peak) stay live while the next micro-batch "
               "runs" if held else ""),
            f"Activations, inputs and temporaries hold {fmt_bytes(growing)} at the peak.",
            "half of the batch-proportional categories at the peak, less the gradients held between micro-batches")
    if facts.get("attention") == "eager" and facts.get("scores_at_peak_bytes", 0) > 0:
        add("fused / flash attention", "fused / flash attention (SDPA), or recompute the scores (selective checkpointing)",
            "activation", facts["scores_at_peak_bytes"],
            f"eager attention ({facts['attention_source']}); the scores live at the peak: "
            f"{fmt_bytes(facts['scores_at_peak_bytes'])} ({facts['scores_source']}); a fused kernel keeps none",
            "torch.nn.functional.scaled_dot_product_attention (attn_implementation=\"sdpa\").",
            "the attention scores live at the peak")
    if train and state > 0 and "8bit" not in (facts.get("optimizer") or "").lower():
        e = 4 if facts.get("fixed_precision") not in ("bf16", "fp16") else 2
        ratio = 1 - (1 + 4 / 2048) / e
        add("8-bit optimizer state", "8-bit Adam (bitsandbytes AdamW8bit)", "optimizer_state", ratio * state,
            f"the optimizer state ({fmt_bytes(state)} at the peak) is {e * 8}-bit today, "
            f"{'Adam-like (' + facts['optimizer'].rsplit('.', 1)[-1] + ')' if facts.get('optimizer') else 'its optimizer not recorded'};"
            " 8 bits per value plus an fp32 absmax per 2048 after",
            f"Optimizer state holds {fmt_bytes(state)} at the peak.", "optimizer state at the peak")
    dist = facts.get("distributed") or {}
    sharded = _sharded(dist)
    if train and dist:
        out += _distributed_levers(facts, dist, at_peak, work)
    if train and state > 0 and not sharded:
        ranks = dp if dp and dp > 1 else facts.get("world_size") or 8
        given = "given" if dp and dp > 1 else ("the recorder's world size" if facts.get("world_size") else
                                              "an example: give --dp in whatif")
        add("shard the optimizer state", f"shard the optimizer state (ZeRO-1 / FSDP) over {ranks} GPUs",
            "optimizer_state", state * (1 - 1 / ranks), f"{ranks} data-parallel ranks ({given}), each keeping 1/{ranks} "
                                                        "of the state",
            f"Optimizer state holds {fmt_bytes(state)} at the peak.", "optimizer state at the peak × (1 - 1/ranks)")
        if dp and dp > 1:
            add("shard the gradients too", f"ZeRO-2 over {dp} GPUs (state and gradients sharded)", "gradient",
                (state + grad) * (1 - 1 / dp), f"{dp} data-parallel ranks (given)",
                f"Gradients and optimizer state hold {fmt_bytes(state + grad)} at the peak.",
                "(optimizer state + gradients) at the peak × (1 - 1/ranks)")
            add("shard the parameters too", f"ZeRO-3 / FSDP over {dp} GPUs (state, gradients and weights sharded)",
                "parameter", (state + grad + param) * (1 - 1 / dp), f"{dp} data-parallel ranks (given); each layer's "
                                                                   "weights are gathered while it runs (not counted)",
                f"Model states hold {fmt_bytes(state + grad + param)} at the peak.",
                "(optimizer state + gradients + parameters) at the peak × (1 - 1/ranks)")
    if train and (grad or state) and not facts.get("lora"):
        add("LoRA adapters", "LoRA adapters instead of full fine-tuning", "gradient", 0.99 * (grad + state),
            "adapters with about 1% of the parameters: gradients and optimizer state only for them",
            f"Gradients and optimizer state hold {fmt_bytes(grad + state)} at the peak.",
            "(gradients + optimizer state) at the peak × 0.99")
    if param > 0:
        width = facts.get("bytes_per_parameter")
        ratio = 1 - 0.5 / width if width else 0.75
        assumes = (f"weights stored at {width:g} bytes per parameter today "
                   f"({facts.get('bytes_per_parameter_source') or 'the recorder'}), 4-bit after" if width
                   else "16-bit weights today (not in the file), 4-bit after")
        name = "4-bit quantized weights (frozen base, e.g. QLoRA)" if train else "8-bit or 4-bit quantized weights"
        add("4-bit quantized weights", name, "parameter", ratio * param, assumes,
            f"Parameters hold {fmt_bytes(param)} at the peak.", "parameters at the peak × (1 - 0.5 B / bytes per weight)")
    if train and facts.get("fixed_precision") == "fp32" and act:
        add("mixed precision", "mixed precision: bf16 autocast (amp)", "activation", act / 2 - param / 2,
            "fp32 weights and activations today (the recorder's dtypes); autocast halves the activations and adds "
            "16-bit copies of the weights (half the parameters' bytes)",
            f"Activations hold {fmt_bytes(act)} at the peak.", "activations / 2 - parameters / 2")
    if train:
        for s in spikes:
            if s["bytes"] >= 0.10 * max(peak, 1) and _looks_like_loss(s):
                add("chunked loss", "chunked loss (or a fused linear + cross-entropy kernel)", "temporary",
                    s["bytes"] * 7 / 8, "the loss computed over 8 chunks of the batch/sequence, so only one chunk's "
                                        "logits are upcast at a time",
                    f"A {fmt_bytes(s['bytes'])} spike comes from the loss.", "the loss's spike × 7/8")
                break
    if work in ("inference", "generation") and kv > 0:
        add("quantize the KV cache", "8-bit KV cache (e.g. a quantized cache)", "kv_cache", kv / 2,
            f"a 16-bit cache today ({fmt_bytes(kv)} at the peak), 8-bit after",
            f"The KV cache holds {fmt_bytes(kv)} at the peak.", "KV cache at the peak / 2")
    if work in ("inference", "generation") and growing > 0 and (batch is None or batch >= 2):
        add("smaller batch", "halve the batch (or the prompt and generation length)", "temporary", growing / 2,
            f"what grows with the batch at the peak ({fmt_bytes(growing)}: activations, temporaries, inputs, KV cache) "
            f"halves with it; the batch is {batch if batch else 'at least 2 (not in the file)'}",
            f"Batch-proportional memory holds {fmt_bytes(growing)} at the peak.",
            "half of the batch-proportional categories at the peak, less the gradients held between micro-batches")
    # expandable segments: the allocator replay's answer (whatif --alloc-conf expandable_segments:True), never a
    # share of the reserved-but-unused bytes (`fragmentation` is no longer read: one computation, issue 31)
    exp = facts.get("expandable")
    if exp and exp["saves_bytes"] > 0 and not facts.get("cpu") and not facts.get("expandable_segments"):
        out.append({"technique": "expandable_segments",
                    "lever": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved memory)",
                    "category": "reserved", "saves_bytes": int(exp["saves_bytes"]), "reserved_only": True,
                    "assumes": "the file's requests served again by the caching-allocator model with expandable "
                               "segments, from the same start (tracekit whatif FILE --alloc-conf "
                               "expandable_segments:True)",
                    "how": f"{exp['text']}.",
                    "evidence": {"rule": "allocator replay: peak reserved under the recorded settings - under "
                                         "expandable_segments:True", "workload": work},
                    "note": "saves reserved, not allocated, memory"})
    out.sort(key=lambda r: -r["saves_bytes"])
    return out


def _sharded(dist: dict) -> bool:
    """The rank's parameters, gradients and optimizer state are sharded already (FSDP, ZeRO-3)."""
    share = dist.get("share")
    return bool(dist) and (str(dist.get("strategy", "")).startswith(("fsdp", "sharded"))
                           or (dist.get("zero_stage") or 0) >= 1 or (share not in (None, "all", "none")))


def _distributed_levers(facts: dict, dist: dict, at_peak: dict, work: str) -> list:
    """FSDP levers (prefetch depth, reshard after forward, CPU offload, mixed-precision parameters, more ranks)
    and DDP levers (gradient_as_bucket_view, sharding), priced from what this rank holds at its peak."""
    out = []

    def add(technique, lever, category, saves, assumes, how, rule):
        if saves > 0:
            out.append({"technique": technique, "lever": lever, "category": category, "saves_bytes": int(saves),
                        "assumes": assumes, "how": how,
                        "evidence": {"rule": rule, "workload": f"{work} ({facts['workload_source']})"}})

    state, grad, param = at_peak.get("optimizer_state", 0), at_peak.get("gradient", 0), at_peak.get("parameter", 0)
    unsh, comm = at_peak.get("unsharded_parameter", 0), at_peak.get("communication", 0)
    world = dist.get("world_size") or facts.get("world_size")
    strategy = str(dist.get("strategy") or "")
    units = [u for u in dist.get("units") or [] if u.get("bytes")]
    if _sharded(dist):
        pre = dist.get("prefetched_bytes_at_peak") or 0
        n = dist.get("unsharded_units_at_peak") or 0
        add("FSDP prefetch depth", "FSDP: no prefetch at the peak's pass (set_modules_to_backward_prefetch([]) / "
                                   "set_modules_to_forward_prefetch([]), or fewer modules to prefetch)",
            "communication", pre,
            f"{dist.get('prefetched_at_peak') or 0} unit(s) all-gathered ahead of their compute at the peak "
            f"({fmt_bytes(pre)} in all-gather outputs not yet copied out); without prefetch the all-gather no longer "
            "overlaps compute (slower)",
            f"{n} unit(s) are unsharded at the peak and {dist.get('prefetched_at_peak') or 0} more prefetched.",
            "the prefetched units' all-gathered bytes at the peak")
        names = dist.get("unsharded_names_at_peak") or []
        gathered = dist.get("unsharded_unit_bytes") or {}
        size = lambda u: gathered.get(u.get("name"), u["bytes"])  # noqa: E731  (bytes as all-gathered)
        # the root keeps its parameters after forward by FSDP's own choice (they are needed first in backward)
        kept = [u for u in units if u.get("reshard_after_forward") is False and u.get("name") != "(root)"
                and u.get("name") in names]
        if len(kept) > 1 and unsh:
            add("reshard after forward", f"FSDP reshard_after_forward=True for {len(kept)} unit(s) that keep their "
                                         "full parameters from forward to backward",
                "unsharded_parameter", min(unsh, sum(size(u) for u in kept)) - max(size(u) for u in kept),
                f"{len(kept)} unit(s) not resharded after forward, unsharded at the peak (the recorder: "
                f"{', '.join(u['name'] for u in kept[:4])}{', ...' if len(kept) > 4 else ''}); resharding frees their "
                "full parameters after forward and all-gathers them again in backward (one more all-gather per unit)",
                f"Unsharded parameters hold {fmt_bytes(unsh)} at the peak.",
                "the all-gathered bytes of the units kept unsharded at the peak, less one unit computing")
        blocks = [u for u in units if u.get("name") in names and u.get("name") != "(root)"]
        root = next((u for u in units if u.get("name") == "(root)" and "(root)" in names), None)
        if blocks:
            big = max(size(u) for u in blocks)
            add("FSDP units per layer", "FSDP: two units per layer (fully_shard the attention and the MLP apart)",
                "unsharded_parameter", len(blocks) * big / 2,
                f"{len(blocks)} layer unit(s) unsharded at the peak, the largest {fmt_bytes(big)} of full parameters "
                "(the recorder's units); halved units gather half as much at a time (more, smaller collectives)",
                f"Unsharded parameters hold {fmt_bytes(unsh)} at the peak.",
                "the layer units unsharded at the peak × half a unit")
        if root is not None and blocks and size(root) > max(size(u) for u in blocks):
            add("FSDP root unit", "FSDP: the embeddings and the output layer as units of their own (fully_shard them "
                                  "before the root)", "unsharded_parameter",
                size(root) - max(size(u) for u in blocks),
                f"the root unit ({fmt_bytes(size(root))} all-gathered: what no other unit holds) is "
                "unsharded at the peak and is larger than a layer; split, only the part that computes is gathered",
                f"The root unit holds {fmt_bytes(size(root))} unsharded at the peak.",
                "root unit - the largest layer unit")
        if not any(u.get("offload") for u in units):
            add("FSDP CPU offload", "FSDP CPU offload (fully_shard(offload_policy=CPUOffloadPolicy()))",
                "parameter", param + grad + state,
                "parameter shards, gradient shards and optimizer state move to host memory (the optimizer step runs "
                "on the CPU: much slower); units are still all-gathered on the device",
                f"Shards and optimizer state hold {fmt_bytes(param + grad + state)} at the peak.",
                "(parameter + gradient + optimizer state) at the peak")
        fp32 = facts.get("fixed_precision") == "fp32" and not any(u.get("param_dtype") for u in units)
        if fp32 and unsh:
            add("FSDP mixed-precision parameters",
                "FSDP mixed precision: MixedPrecisionPolicy(param_dtype=torch.bfloat16)", "unsharded_parameter",
                unsh / 2 + comm / 2,
                "fp32 parameters all-gathered today (the recorder: no param_dtype); bf16 halves the unsharded units "
                "and the collective buffers, shards and optimizer state stay fp32",
                f"Unsharded parameters hold {fmt_bytes(unsh)} and collective buffers {fmt_bytes(comm)} at the peak.",
                "(unsharded parameters + communication) at the peak / 2")
        if world and world > 1:
            add("shard over more ranks", f"FSDP over {2 * world} ranks instead of {world}", "parameter",
                (param + grad + state) / 2,
                f"{world} ranks today (the recorder); each rank keeps half the shards with twice the ranks "
                "(units are all-gathered whole either way)",
                f"Shards and optimizer state hold {fmt_bytes(param + grad + state)} at the peak.",
                "(parameter + gradient + optimizer state) at the peak / 2")
    elif strategy == "ddp":
        bucket = dist.get("bucket_bytes")
        if dist.get("gradient_as_bucket_view") is False and comm:
            add("DDP gradient_as_bucket_view", "DDP(gradient_as_bucket_view=True)", "communication",
                min(comm, max(grad, facts.get("gradient_bytes") or 0) or comm),
                "gradients become views of DDP's buckets: the second copy of every gradient (the buckets, "
                f"{fmt_bytes(comm)} at the peak) goes; the bucket size "
                + (f"({fmt_bytes(bucket)} now, bucket_cap_mb) " if bucket else "")
                + "changes how many buckets there are, not their total (every gradient has a slot in one)",
                f"DDP's gradient buckets hold {fmt_bytes(comm)} at the peak.",
                "min(collective buffers, gradients) at the peak")
        if world and world > 1 and param + grad + state:
            n_blocks = facts.get("blocks") or 0
            unit = param / n_blocks if n_blocks else 0
            add("FSDP instead of DDP", f"FSDP (fully_shard per block) over the {world} ranks instead of DDP",
                "parameter", (param + grad + state) * (1 - 1 / world) + comm - 2 * unit,
                f"{world} ranks (the recorder): parameters, gradients and optimizer state 1/{world} per rank, no "
                "gradient buckets; two blocks' full parameters all-gathered at a time"
                + ("" if n_blocks else " (the blocks are not known: not counted)"),
                f"Parameters, gradients and optimizer state hold {fmt_bytes(param + grad + state)} at the peak.",
                "(parameter + gradient + optimizer state) × (1 - 1/ranks) + buckets - 2 blocks' parameters")
    return out


def _looks_like_loss(spike) -> bool:
    """The spike's largest sites run in a loss (their user frames name it; an attention softmax does not)."""
    words = ("loss", "cross_entropy", "log_softmax", "logits", "nll")
    for g in spike.get("top_stacks", [])[:2]:
        for f in g["frames"][:4]:
            if any(w in f["name"].lower() for w in words):
                return True
    return False


def not_offered(facts: dict) -> list[str]:
    """Levers left out because the file contradicts them, in words (shown with the levers)."""
    out = []
    if facts["workload"] != "training":
        out.append(f"no gradient accumulation, optimizer, LoRA or checkpointing levers: "
                   f"{'an' if facts['workload'] == 'inference' else 'a'} {facts['workload']} run "
                   f"({facts['workload_source']})")
    if facts.get("checkpointing"):
        out.append("no activation checkpointing lever: checkpointing already runs (torch/utils/checkpoint.py in the stacks)")
    elif facts["workload"] == "training" and not (facts.get("blocks") and facts["blocks"] >= 2):
        out.append("no activation checkpointing lever: the file does not show repeated blocks")
    if facts.get("attention") == "flash":
        out.append(f"no flash-attention lever: {facts['attention_source']}")
    elif facts.get("attention") is None:
        out.append("no flash-attention lever: the stacks show no attention kernel, eager or fused")
    if facts.get("lora"):
        out.append("no LoRA lever: most parameters are frozen already")
    exp = facts.get("expandable")
    if facts.get("expandable_segments"):
        out.append("no expandable-segments lever: the file was recorded with expandable_segments:True")
    elif exp is not None and exp["saves_bytes"] <= 0:
        out.append(f"no expandable-segments lever: {exp['text'][0].lower()}{exp['text'][1:]}")
    return out
