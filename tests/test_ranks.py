"""Many ranks: `tracekit report DIR`, the summaries the recorder writes beside each rank's file,
the imbalance; figures checked against independent replays of the raw files (tests/oracle.py)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import tracekit
from tracekit.analysis.ranks import assign_ranks, imbalance, is_summary, rank_of_name, summarize
from tracekit.cli import cli
from tracekit.io.rank_files import rank_files, read_summary, summary_path
from tracekit.analysis.rank_pool import open_ranks

from .oracle import naive_replay

torch = pytest.importorskip("torch")
BATCH = {0: 8, 1: 8, 2: 16}  # rank 2 is given twice the batch: the planted imbalance


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A folder as a 3-rank job leaves it: run.rankN.pickle + run.rankN.pickle.summary.json (by the recorder)."""
    from .pairs import record_run

    d = tmp_path_factory.mktemp("job")
    raw = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRACEKIT_RANK_SUMMARY", raising=False)
        mp.setenv("WORLD_SIZE", "3")
        for rank, batch in BATCH.items():
            mp.setenv("RANK", str(rank))
            raw[rank] = record_run(d / "run.pickle", batch=batch, steps=1)  # the recorder adds .rankN
    return d, {r: (d / f"run.rank{r}.pickle", raw[r]) for r in raw}


def test_the_recorder_writes_a_summary_beside_each_rank(job):
    d, files = job
    assert sorted(os.listdir(d)) == sorted([f"run.rank{r}.pickle" for r in BATCH] +
                                           [f"run.rank{r}.pickle.summary.json" for r in BATCH])
    for rank, (path, raw) in files.items():
        s = read_summary(path)
        assert s["rank"] == rank and s["world_size"] == 3
        (dev,) = s["devices"]
        assert dev["peak_allocated_bytes"] == naive_replay(raw)["peak"]
        assert os.path.getsize(summary_path(path)) < os.path.getsize(path) / 10
        # the summary says what a full analysis of the file says
        full = summarize(tracekit.load(path))
        assert {k: v for k, v in full["devices"][0].items()} == dev and full["findings"] == s["findings"]


def test_rank_report_names_the_planted_outlier(job):
    d, files = job
    table = open_ranks([d])
    assert table["rank_source"] == "the recorder's metadata" and table["from_summaries"] == 3
    assert [r["rank"] for r in table["ranks"]] == [0, 1, 2]
    for row in table["ranks"]:
        assert row["peak_allocated_bytes"] == naive_replay(files[row["rank"]][1])["peak"]
    imb = table["imbalance"]
    peaks = [naive_replay(files[r][1])["peak"] for r in BATCH]
    assert imb["max_rank"] == 2 and imb["max_over_min"] == round(max(peaks) / min(peaks), 4)
    out = imb["outlier"]
    assert out["rank"] == 2 and out["over_others_bytes"] == peaks[2] - (peaks[0] + peaks[1]) / 2
    assert out["by_category"][0]["category"] == "activation"  # twice the batch: twice the activations
    act = [r["categories_at_peak"]["activation"] for r in table["ranks"]]
    assert 1.9 <= act[2] / act[0] <= 2.1


def test_summaries_are_trusted_only_for_their_own_file(job, tmp_path):
    d, files = job
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)  # a copied folder keeps its summaries valid
    assert open_ranks([copy])["from_summaries"] == 3
    os.unlink(copy / "run.rank0.pickle.summary.json")
    shutil.copy(d / "run.rank0.pickle", copy / "run.rank1.pickle")  # recorded again: rank 1's summary is stale
    (copy / "run.rank2.pickle.summary.json").write_text("{not json")
    # a summary of the right file whose fields are of the wrong type is not trusted either
    assert read_summary(copy / "run.rank2.pickle") is None
    shutil.copy(d / "run.rank2.pickle.summary.json", copy / "run.rank2.pickle.summary.json")
    bad = json.loads((copy / "run.rank2.pickle.summary.json").read_text())
    bad["devices"][0]["categories_at_peak"] = {"activation": "lots"}
    (copy / "run.rank2.pickle.summary.json").write_text(json.dumps(bad))
    table = open_ranks([copy])
    assert table["from_summaries"] == 0 and table["analysed"] == 3
    assert open_ranks([d], use_summaries=False)["analysed"] == 3
    assert is_summary(read_summary(d / "run.rank0.pickle")) and not is_summary(bad)


def test_the_pool_gives_what_one_process_gives(job):
    d, _ = job
    one = open_ranks([d], jobs=1, use_summaries=False)
    two = open_ranks([d], jobs=2, use_summaries=False)
    assert two["workers"] == 2 and one["workers"] == 1
    for key in ("ranks", "imbalance", "rank_source"):
        assert one[key] == two[key]


def test_rank_assignment():
    assert rank_of_name("/x/mem.rank12.pickle") == 12 and rank_of_name("rank_3.json.gz") == 3
    assert rank_of_name("run-rank7-step.pkl") == 7 and rank_of_name("ranking.pickle") is None
    assert rank_of_name("/rank3/mem.pickle") is None  # folders do not count
    s = [{"rank": 1}, {"rank": 0}]
    assert assign_ranks(s, ["a.rank5.pickle", "b.rank6.pickle"]) == ([1, 0], "the recorder's metadata")
    assert assign_ranks([{}, {}], ["a.rank5.pickle", "b.rank6.pickle"]) == ([5, 6], "the file names")
    assert assign_ranks([{"rank": 0}, {"rank": 0}], ["a.pickle", "b.pickle"]) == ([0, 1], "the order given")


def _row(rank, peak, **cats):
    return {"rank": rank, "peak_allocated_bytes": peak, "categories_at_peak": cats}


def test_imbalance():
    rows = [_row(0, 100 << 20, activation=60 << 20), _row(1, 101 << 20, activation=61 << 20),
            _row(2, 160 << 20, activation=100 << 20, temporary=20 << 20), _row(3, 99 << 20, activation=59 << 20)]
    imb = imbalance(rows)
    assert (imb["min_rank"], imb["max_rank"], imb["max_over_min"]) == (3, 2, round(160 / 99, 4))
    assert imb["median_bytes"] == int(100.5 * 2**20)
    o = imb["outlier"]  # against the other three: median 100 MiB, 60 MiB of activations
    assert o["rank"] == 2 and o["others_bytes"] == 100 << 20 and o["over_others_bytes"] == 60 << 20
    assert [c["category"] for c in o["by_category"]] == ["activation", "temporary"]
    assert o["by_category"][0]["bytes"] == 40 << 20 and o["by_category"][1]["bytes"] == 20 << 20
    two = imbalance([_row(0, 10 << 20), _row(1, 19 << 20)])["outlier"]  # two ranks: the larger, against the other
    assert two["rank"] == 1 and two["over_others_bytes"] == 9 << 20 and two["relative"] == 0.9
    balanced = imbalance([_row(0, 100 << 20), _row(1, 102 << 20), _row(2, 101 << 20)])
    assert balanced["outlier"] is None and balanced["max_over_min"] == 1.02
    assert imbalance([_row(0, 5)]) is None


def test_cli_folder_text_and_json(job):
    d, _ = job
    r = CliRunner().invoke(cli, ["report", str(d)])
    assert r.exit_code == 0, r.output
    assert "3 ranks (ranks from the recorder's metadata; 3 read from the summaries" in r.output
    assert "Outlier: rank 2 peaks at" in r.output and "against the other ranks' median" in r.output
    assert "by category: activation +" in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip().startswith(("0 ", "1 ", "2 "))]
    assert len(lines) == 3 and all("backward" in ln for ln in lines)
    out = json.loads(CliRunner().invoke(cli, ["report", "--json", str(d)]).output)
    assert out["imbalance"]["outlier"]["rank"] == 2
    # several files given one by one: the same rows
    files = [str(p) for p in rank_files([d])]
    again = json.loads(CliRunner().invoke(cli, ["report", "--json", *files]).output)
    assert again["ranks"] == out["ranks"]


def test_a_bad_rank_file_is_one_line_and_exit_2_after_the_others(job, tmp_path):
    d, _ = job
    shutil.copytree(d, tmp_path / "j")
    (tmp_path / "j" / "run.rank3.pickle").write_bytes(b"\x80\x04garbage")
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", "report", str(tmp_path / "j")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Outlier: rank 2" in r.stdout and "not read: cannot open" in r.stdout
    assert r.stderr.count("\n") == 1 and "1 of 4 files could not be read" in r.stderr
    r = CliRunner().invoke(cli, ["report", str(d), "--estimate-config", "gpt2"])
    assert r.exit_code == 2 and "apply to one FILE" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", "report", str(empty)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "holds no recordings" in r.stderr and "Traceback" not in r.stderr


def test_no_summary_for_a_single_process(tmp_path, monkeypatch):
    from .pairs import record_run

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TRACEKIT_RANK_SUMMARY"):
        monkeypatch.delenv(var, raising=False)
    record_run(tmp_path / "one.pickle", steps=1, warmup=0)
    assert os.listdir(tmp_path) == ["one.pickle"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_ddp_one_rank_with_a_bigger_batch(tmp_path, nproc):
    """A real multi-process job: torchrun, gloo, DistributedDataParallel; the last rank trains on twice the batch."""
    big = nproc - 1
    import shutil as _sh

    torchrun = _sh.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                            "TRACEKIT_RANK_SUMMARY")}
    script = os.path.join(os.path.dirname(__file__), "ddp_train.py")
    p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", str(nproc), script, str(tmp_path), str(big)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=os.path.dirname(script), start_new_session=True)
    try:
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # torchrun and its workers: their own process group
        p.communicate()
        raise
    assert p.returncode == 0, err[-2000:]
    assert sorted(os.listdir(tmp_path)) == sorted(f"ddp.rank{r}.pickle{s}" for r in range(nproc)
                                                  for s in ("", ".summary.json"))
    table = open_ranks([tmp_path])
    assert table["rank_source"] == "the recorder's metadata" and table["from_summaries"] == nproc
    raw = {}
    for rank in range(nproc):
        with open(tmp_path / f"ddp.rank{rank}.pickle", "rb") as f:
            from tracekit.io.unpickle import restricted_load

            raw[rank] = restricted_load(f)
        assert table["ranks"][rank]["peak_allocated_bytes"] == naive_replay(raw[rank])["peak"]
        assert raw[rank]["tracekit"]["settings"]["rank"] == rank
    out = table["imbalance"]["outlier"]
    assert out["rank"] == big and out["by_category"][0]["category"] == "activation"
    text = CliRunner().invoke(cli, ["report", str(tmp_path)]).output
    assert f"Outlier: rank {big} peaks at" in text and "activation +" in text


def test_a_failing_summary_is_a_warning_and_ctrl_c_is_not_swallowed(tmp_path, monkeypatch):
    import tracekit.analysis.ranks as ranks_module

    from .pairs import record_run

    monkeypatch.setenv("TRACEKIT_RANK_SUMMARY", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(ranks_module, "summarize", broken)
    with pytest.warns(RuntimeWarning, match="could not write the summary"):
        raw = record_run(tmp_path / "a.pickle", steps=1, warmup=0)
    assert raw["tracekit"]["settings"]["steps"] == 1 and os.listdir(tmp_path) == ["a.pickle"]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ranks_module, "summarize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        record_run(tmp_path / "b.pickle", steps=1, warmup=0)
    assert (tmp_path / "b.pickle").exists()  # the recording was written before
