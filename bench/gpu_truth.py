#!/usr/bin/env python3
"""Real runs on a lent CUDA card, for truth to hold `tracekit simulate` and the estimates against
(scripts/gpu_session.sh's steps `truth` and `alloc`):

  python3 bench/gpu_truth.py truth --scripts .gpu/scripts --out $OUT [--jobs 4]
  python3 bench/gpu_truth.py alloc --scripts .gpu/scripts --out $OUT

Each script runs unmodified, with the arguments tests/test_simulate_scripts.py and ../shared/bench/score_simulate.py
give it, under `gpu_truth.py wrap`: NVML's device-used before CUDA starts, torch's history from the start
(python stacks), and an atexit hook that writes the process's counters (max allocated / reserved, ...), NVML at the
end and a gzipped snapshot. `probe` is the ledger alone on the card: device used = reserved + context + libraries.
--scripts is a copy of ../shared/fixtures/scripts (../shared does not travel to the device); without it only our own
scripts run. Pure-python packages the shared scripts import (einops, einx, jaxtyping) are read from --pylib.
Writes OUT/truth.tgz (or alloc.tgz) and OUT/truth.log (alloc.log), a line per run.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import gzip
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OURS = os.path.join(ROOT, "tests", "simulate_scripts")
SNAP_MAX = 3 << 20  # a gzipped snapshot over this is left out
TAR_BUDGET = 14 << 20  # the device tool brings back 16 MiB a file

# ---------------------------------------------------------------------------------------------------- the wrapper


def nvml_state():
    """Device used and the compute processes NVML sees (pids may be the host's inside a container)."""
    try:
        import pynvml as nv
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0] or 0))
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        procs = [{"pid": p.pid, "used": p.usedGpuMemory} for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
        own = [p["used"] for p in procs if p["pid"] == os.getpid()]
        return {"used": mem.used, "total": mem.total, "procs": procs, "own": own[0] if own else None}
    except Exception as e:  # no pynvml, no driver
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def torch_state(torch):
    c = torch.cuda
    st = c.memory_stats()
    keep = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak", "requested_bytes.all.peak",
            "segment.all.current", "segment.all.peak", "num_alloc_retries", "num_ooms", "num_device_alloc",
            "num_device_free", "num_sync_all_streams")
    free, total = c.mem_get_info()
    return {"max_allocated": c.max_memory_allocated(), "max_reserved": c.max_memory_reserved(),
            "allocated": c.memory_allocated(), "reserved": c.memory_reserved(), "free": free, "total": total,
            "stats": {k: st.get(k) for k in keep}}


def wrap(argv):
    """python3 gpu_truth.py wrap SCRIPT ARGS...: run SCRIPT as __main__; TRUTH_RECORD / TRUTH_SNAP name the outputs."""
    import atexit
    import runpy
    t0 = time.time()
    record, snap = os.environ.get("TRUTH_RECORD"), os.environ.get("TRUTH_SNAP")
    rec = {"script": argv[0], "argv": argv[1:], "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "nvml_before": nvml_state()}
    import torch
    rec.update(torch=torch.__version__, cuda_version=torch.version.cuda, python=sys.version.split()[0])
    cuda = torch.cuda.is_available()
    rec["cuda"] = cuda
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=int(os.environ.get("TRUTH_ENTRIES", "200000")),
                                                 stacks="python")

    def done():
        if "seconds" in rec:
            return
        rec["seconds"] = round(time.time() - t0, 2)
        try:
            if not cuda:
                rec["note"] = "no cuda: torch.cuda.is_available() is False"
            else:
                torch.cuda.synchronize()
                rec["card"] = torch.cuda.get_device_name()
                rec["cudnn"] = torch.backends.cudnn.version()
                rec.update(torch_state(torch))
                rec["nvml_end"] = nvml_state()
                if snap:
                    data = gzip.compress(pickle.dumps(torch.cuda.memory._snapshot()), 6)
                    rec["snapshot_gz_bytes"] = len(data)
                    if len(data) <= SNAP_MAX:
                        open(snap, "wb").write(data)
                    else:
                        rec["snapshot"] = "left out: over 3 MB gzipped"
        except Exception as e:
            rec["hook_error"] = f"{type(e).__name__}: {e}"[:500]
        if record:
            with open(record, "w") as f:
                json.dump(rec, f)

    atexit.register(done)  # os._exit skips both; a signal (the timeout) leaves no record
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        rec["exit"] = 0
    except SystemExit as e:
        rec["exit"] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except BaseException as e:
        rec["exit"] = 1
        rec["exception"] = f"{type(e).__name__}: {e}"[:500]
        raise
    finally:
        done()  # at the script's end, its module's objects gone as they would be at exit

# -------------------------------------------------------------------------------------------------- the ledger


def probe(kind):
    """The ledger on an otherwise idle card, one line per moment: NVML device used against torch's reserved."""
    before = nvml_state()
    import torch
    lines = []

    def mark(what):
        torch.cuda.synchronize()
        n = nvml_state()
        t = torch_state(torch)
        row = {"probe": kind, "moment": what, "nvml_used": n.get("used"), "nvml_own": n.get("own"),
               "nvml_procs": n.get("procs"), "reserved": t["reserved"], "allocated": t["allocated"],
               "cuda_free": t["free"], "total": t["total"]}
        if isinstance(n.get("used"), int) and isinstance(before.get("used"), int):
            row["delta_used"] = n["used"] - before["used"]
            row["outside_torch"] = row["delta_used"] - t["reserved"]  # context + libraries (+ anyone else)
        lines.append(row)
        print(json.dumps(row), flush=True)

    print(json.dumps({"probe": kind, "moment": "before CUDA", "nvml": before, "torch": torch.__version__,
                      "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING")}), flush=True)
    if not torch.cuda.is_available():
        print(json.dumps({"probe": kind, "note": "no cuda"}))
        return
    torch.cuda.init()
    mark("torch.cuda.init()")
    x = torch.empty(1, device="cuda")
    mark("first tiny alloc")
    x.add_(1)
    mark("first elementwise kernel")
    if kind in ("fp32", "bf16", "fp16"):
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kind]
        a = torch.randn(1024, 1024, device="cuda", dtype=dt)
        mark("randn")
        (a @ a).sum().item()
        mark(f"first {kind} matmul (cuBLAS handle + workspace)")
        w = torch.nn.Linear(1024, 1024, device="cuda", dtype=dt)
        w(a).sum().backward()
        mark(f"{kind} linear fwd+bwd (cublasLt)")
        if kind == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True
            (a @ a).sum().item()
            mark("tf32 matmul")
    elif kind == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        q, k, v = (torch.randn(4, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mark("q, k, v")
        for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            try:
                with sdpa_kernel(getattr(SDPBackend, b)):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                mark(f"sdpa {b} fwd+bwd")
            except Exception as e:
                print(json.dumps({"probe": kind, "moment": f"sdpa {b}", "error": f"{type(e).__name__}: {e}"[:300]}))
    torch.cuda.empty_cache()
    mark("after empty_cache")

# ------------------------------------------------------------------------------------------------------ the runs

LOAD_WEIGHTS_PREP = (
    "import torch, transformers, sys\n"
    "cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
    "num_attention_heads=4, num_key_value_heads=2, vocab_size=500)\n"
    "m = transformers.Qwen2ForCausalLM(cfg); m.save_pretrained(sys.argv[1] + '/tiny')\n"
    "torch.save(m.state_dict(), sys.argv[1] + '/sd.pt')\n")

HF = ["--amp", "--batch", "4", "--seq", "256", "--mode", "torch", "--steps", "2", "--out", "sim.pickle"]


def truth_cases():
    """(name, kind, ...): `ours` runs tests/simulate_scripts/SCRIPT in a scratch dir; `shared` copies the folder."""
    c = [
        # the compiled one first: it takes longest
        dict(name="adamw_full_step_compiled", dir="adamw_full_step_compiled", pythonpath=["."],
             argv=["benchmarking_script.py"], timeout=240),
        dict(name="train_mlp_dump", script="train_mlp.py", argv=["--dump", "dump.pickle"]),
        dict(name="train_mlp_bf16", script="train_mlp.py", argv=["--amp", "bf16"]),
        dict(name="train_mlp_bf16_ckpt", script="train_mlp.py", argv=["--amp", "bf16", "--ckpt", "nonreentrant"]),
        dict(name="train_mlp_fp16_sgd_accum", script="train_mlp.py",
             argv=["--amp", "fp16", "--opt", "sgd", "--accum", "2", "--set-to-none", "0"]),
        dict(name="streams", script="streams.py", argv=[]),
        dict(name="generate_hf_dynamic", script="generate_hf.py", argv=["dynamic"]),
        dict(name="generate_hf_static", script="generate_hf.py", argv=["static"]),
        dict(name="moe", script="moe.py", argv=[]),
        dict(name="lora", script="lora.py", argv=[]),
        dict(name="load_weights", script="load_weights.py", argv=["."], prep=LOAD_WEIGHTS_PREP),
        dict(name="trainer_hf", script="trainer_hf.py", argv=[]),
        dict(name="hf_qwen2_amp", dir="hf_cuda", argv=["train_hf.py", "--model", "qwen2"] + HF),
        dict(name="hf_opt_amp", dir="hf_cuda", argv=["train_hf.py", "--model", "opt"] + HF),
        dict(name="hf_neox_amp", dir="hf_cuda", argv=["train_hf.py", "--model", "neox"] + HF),
        dict(name="hf_qwen2_generate", dir="hf_cuda", argv=["kv_dev.py", "sim.pickle", "2", "256", "128"]),
        dict(name="attention_fwd_bwd", dir="attention_fwd_bwd", argv=["trace_peak_memory.py"]),
        dict(name="windows_small_fwd_bwd", dir="windows_small_fwd_bwd", pythonpath=[".", "cs336-basics"],
             argv=["cs336_systems/benchmarking_script.py"]),
        # score_simulate's one edit: the run's model returned {"logits": ...}, the published one a tensor
        dict(name="fp32_forward_no_grad", dir="fp32_forward_no_grad", cwd="assignment2-systems",
             pythonpath=[".", "../assignment1-basics"], argv=["cs336_systems/benchmark.py"],
             edits=[("cs336_systems/benchmark.py", '(input_ids)["logits"]', "(input_ids)")]),
        # alone, last: it fills the card
        dict(name="oom", script="oom.py", argv=[], alone=True),
    ]
    return c


def alloc_cases():
    base = ["train_hf.py", "--model", "qwen2"] + HF[:-1]
    return [dict(name=f"qwen2_amp_{tag}", dir="hf_cuda", argv=base + [f"{tag}.pickle"], env={"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {})
            for tag, conf in (("default", None), ("expandable", "expandable_segments:True"),
                              ("split128", "max_split_size_mb:128"))]


def run_case(c, a, work, res_dir):
    try:
        return _run_case(c, a, work, res_dir)
    except Exception as e:  # one case's trouble is its own line
        return {"name": c["name"], "error": f"{type(e).__name__}: {e}"[:500]}


def _run_case(c, a, work, res_dir):
    name = c["name"]
    tmp = os.path.join(work, name)
    shutil.rmtree(tmp, ignore_errors=True)
    row = {"name": name}
    left = a.end - time.time()  # the session's deadline: what is not started by then is skipped, not lost
    if left < 15:
        return {**row, "skipped": "deadline"}
    limit = int(min(c.get("timeout", a.timeout), left))
    if "dir" in c:
        src = os.path.join(a.scripts or "", c["dir"])
        if not a.scripts or not os.path.isdir(src):
            return {**row, "skipped": f"no {src}"}
        shutil.copytree(src, tmp)
        cwd = os.path.join(tmp, c.get("cwd", ""))
        script = os.path.join(cwd, c["argv"][0])
        args = c["argv"][1:]
    else:
        os.makedirs(tmp)
        cwd = tmp
        script = os.path.join(OURS, c["script"])
        args = c["argv"]
    for f, old, new in c.get("edits", []):
        p = os.path.join(cwd, f)
        text = open(p).read()  # read before opening for writing: open(p, "w") truncates it first
        open(p, "w").write(text.replace(old, new))
        row["edited"] = f"{f}: {old} -> {new}"
    before = set(glob.glob(os.path.join(tmp, "**", "*"), recursive=True))
    pp = [os.path.join(cwd, x) for x in c.get("pythonpath", [])]
    if a.pylib and os.path.isdir(a.pylib):
        pp.append(os.path.abspath(a.pylib))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(pp + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               TRUTH_RECORD=os.path.join(tmp, ".truth_record.json"),
               TRUTH_SNAP=os.path.join(res_dir, "snap", name + ".pickle.gz"), **c.get("env", {}))
    env.setdefault("OMP_NUM_THREADS", "4")  # four at once on 16 cores
    if "PYTORCH_CUDA_ALLOC_CONF" not in c.get("env", {}):
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the allocator's defaults unless the case names a setting
    log = os.path.join(res_dir, "logs", name + ".log")
    t = time.time()
    with open(log, "w") as lf:
        if c.get("prep"):
            p = subprocess.run([sys.executable, "-c", c["prep"], cwd], cwd=cwd, env=env, stdout=lf,
                               stderr=subprocess.STDOUT, timeout=120)
            row["prep_rc"] = p.returncode
        lf.write(f"$ {' '.join([script] + args)}\n")
        lf.flush()
        try:
            # TRUTH_LAUNCH: a prefix for a dry run on a CPU machine, e.g. "python -m tracekit simulate --gpu H100 --"
            launch = shlex.split(os.environ.get("TRUTH_LAUNCH", ""))
            p = subprocess.run(launch + [sys.executable, os.path.abspath(__file__), "wrap", script] + args, cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=lf, text=True, timeout=limit)
            row["rc"], out = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            row["rc"], row["timed_out"] = None, limit
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        lf.write("--- stdout\n" + out[-100000:])
    row["seconds"] = round(time.time() - t, 1)
    results = [x[7:] for x in out.splitlines() if x.startswith("RESULT ")]
    if results:
        try:
            row["RESULT"] = json.loads(results[-1])
        except ValueError:
            row["RESULT"] = results[-1][:2000]
    rp = env["TRUTH_RECORD"]
    row["wrapper"] = json.load(open(rp)) if os.path.exists(rp) else None
    produced = []
    for f in sorted(set(glob.glob(os.path.join(tmp, "**", "*"), recursive=True)) - before):
        if os.path.isfile(f) and f.endswith((".pickle", ".pkl", ".json")) and f != rp and "/tiny/" not in f:
            data = gzip.compress(open(f, "rb").read(), 6)
            rel = os.path.relpath(f, tmp).replace(os.sep, "__")
            if len(data) <= SNAP_MAX:
                open(os.path.join(res_dir, "produced", f"{name}__{rel}.gz"), "wb").write(data)
                produced.append({"file": rel, "gz_bytes": len(data)})
            else:
                produced.append({"file": rel, "gz_bytes": len(data), "left_out": True})
    row["produced"] = produced
    shutil.rmtree(tmp, ignore_errors=True)
    return row


def summary(row):
    w = row.get("wrapper") or {}
    r = row.get("RESULT") if isinstance(row.get("RESULT"), dict) else {}
    mib = lambda b: f"{b / 2**20:.1f}" if isinstance(b, (int, float)) else "-"
    if row.get("skipped") or row.get("error"):
        return f"{row['name']}: {'skipped' if row.get('skipped') else 'error'} ({row.get('skipped') or row['error']})"
    s = (f"{row['name']}: rc={row.get('rc')}{' TIMEOUT' if row.get('timed_out') else ''} {row.get('seconds')}s"
         f" max_alloc={w.get('max_allocated')} max_res={w.get('max_reserved')} ({mib(w.get('max_reserved'))} MiB)")
    if r.get("max_allocated") is not None:
        s += f" RESULT.max_alloc={r.get('max_allocated')} RESULT.max_res={r.get('max_reserved')}"
    n = (w.get("nvml_end") or {})
    if n.get("used") is not None:
        s += f" nvml_used={mib(n['used'])}MiB own={mib(n.get('own'))}"
    if w.get("note"):
        s += f" [{w['note']}]"
    if w.get("exception"):
        s += f" [{w['exception'][:120]}]"
    return s


def tar_up(res_dir, dest, name):
    """The tarball, within the budget: the largest snapshots go first when it is over."""
    def size():
        return sum(os.path.getsize(f) for f in glob.glob(os.path.join(res_dir, "**", "*"), recursive=True)
                   if os.path.isfile(f))
    dropped = []
    gz = sorted(glob.glob(os.path.join(res_dir, "produced", "*")) + glob.glob(os.path.join(res_dir, "snap", "*")),
                key=os.path.getsize, reverse=True)
    while size() > TAR_BUDGET and gz:
        f = gz.pop(0)
        dropped.append(os.path.relpath(f, res_dir))
        os.remove(f)
    if dropped:
        open(os.path.join(res_dir, "dropped.txt"), "w").write("\n".join(dropped) + "\n")
    with tarfile.open(dest, "w:gz") as t:
        t.add(res_dir, arcname=name)
    return dropped


def session(a, step):
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    work = os.path.join(a.work, step)
    res_dir = os.path.join(work, "_" + step)
    shutil.rmtree(work, ignore_errors=True)
    for d in ("logs", "snap", "produced"):
        os.makedirs(os.path.join(res_dir, d))
    t0 = time.time()
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    env = {"python": sys.version.split()[0], "scripts": a.scripts, "pylib": a.pylib}
    try:
        import torch
        env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                   card=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        import transformers
        env["transformers"] = transformers.__version__
    except Exception as e:
        env["error"] = repr(e)[:300]
    env["nvml"] = nvml_state()
    json.dump(env, open(os.path.join(res_dir, "env.json"), "w"), indent=1)
    say(f"{step}: {json.dumps({k: env.get(k) for k in ('torch', 'cuda', 'card', 'transformers')})}")
    if step == "truth" and not a.no_probe:
        with open(os.path.join(res_dir, "probe.jsonl"), "w") as pf:
            for kind in ("fp32", "bf16", "sdpa"):
                try:
                    p = subprocess.run([sys.executable, os.path.abspath(__file__), "probe", kind], capture_output=True,
                                       text=True, timeout=60)
                    pf.write(p.stdout)
                    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
                    led = [f"{r['moment']}: +{r['delta_used'] / 2**20:.0f} MiB used, reserved {r['reserved'] / 2**20:.0f}"
                           for r in rows if "delta_used" in r]
                    say(f"probe {kind} rc={p.returncode}: " + ("; ".join(led) if led else
                        (rows[-1] if rows else p.stderr.strip()[-300:])).__str__())
                except subprocess.TimeoutExpired:
                    say(f"probe {kind}: timed out")
    cases = truth_cases() if step == "truth" else alloc_cases()
    if a.only:
        cases = [c for c in cases if c["name"] in a.only]
    rows = []
    with open(os.path.join(res_dir, "results.jsonl"), "w") as rf:
        def keep(row):
            rf.write(json.dumps(row) + "\n")
            rf.flush()
            rows.append(row)
            say(summary(row))
        with cf.ThreadPoolExecutor(a.jobs) as ex:
            futs = [ex.submit(run_case, c, a, work, res_dir) for c in cases if not c.get("alone")]
            for f in cf.as_completed(futs):
                keep(f.result())
        for c in cases:
            if c.get("alone"):
                keep(run_case(c, a, work, res_dir))
    say(f"{step}: {len(rows)} runs, {sum(1 for r in rows if r.get('rc') == 0)} exit 0, {time.time() - t0:.0f} s")
    dropped = tar_up(res_dir, os.path.join(out, f"{step}.tgz"), step)
    if dropped:
        say(f"left out of {step}.tgz for size: {', '.join(dropped)}")
    open(os.path.join(out, f"{step}.log"), "w").write("\n".join(lines) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "wrap":
        return wrap(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        return probe(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["truth", "alloc"])
    ap.add_argument("--scripts", default=os.path.join(ROOT, ".gpu", "scripts"))
    ap.add_argument("--pylib", default=os.path.join(ROOT, ".gpu", "pylib"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_out"))
    ap.add_argument("--work", default="/tmp/gpu_truth_work")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=90, help="seconds a script (the compiled one: 240)")
    ap.add_argument("--deadline", type=int, default=0, help="seconds for the step: each run is cut to end by then (truth 200, alloc 60)")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--no-probe", action="store_true")
    a = ap.parse_args()
    a.end = time.time() + (a.deadline or {"truth": 200, "alloc": 60}[a.step])
    session(a, a.step)


if __name__ == "__main__":
    main()
