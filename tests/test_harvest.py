"""engine.harvest on the eager backend (no vLLM here; see test_harvest_vllm.py): harvested rows equal
run_with_cache, kill -9 then resume equals an uninterrupted run byte for byte, parts union equals one
part, mixing and bad input refused, readers, and peak memory independent of the dataset's size."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.core.errors import AddressError
from engine.harvest import (
    SAMPLE,
    HarvestDataset,
    InputError,
    MixingError,
    harvest,
    hf_dataset,
    read_manifest,
    runner,
    verify,
)
from engine.harvest import manifest as mf
from engine.harvest.capture import PointError
from engine.loading import load_model

LLAMA = "meta-llama/Llama-3.2-1B"
POINTS = ["resid_post.1", "mlp_out.0", "z.0.head-1"]
ROOT = Path(__file__).resolve().parents[1]
LINES = SAMPLE.read_text().splitlines()
LONG = " ".join(LINES[:6])  # ~120 tokens: several 32-token windows
DOCS = LINES[:14] + [""] + [LONG] + LINES[14:20]  # an empty row keeps its index and yields nothing
KW = dict(shard_tokens=100, context=32, batch_tokens=128, progress=False)


@pytest.fixture(scope="module")
def model():
    return load_model(LLAMA, source="zoo")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "docs.txt"
    p.write_text("\n".join(DOCS) + "\n")
    return p


def env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))


def all_rows(out) -> dict[str, torch.Tensor]:
    ds = HarvestDataset(out)
    shards = list(ds.iter_shards())
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def windows_of(model, text: str, context: int):
    ids = model.tokenizer(text)["input_ids"]
    return [(s, ids[s:s + context]) for s in range(0, len(ids), context)]


def strip(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in mf.TIMESTAMPS}


def tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_rows_equal_run_with_cache_every_point_every_shard(model, data, tmp_path):
    out = tmp_path / "out"
    s = harvest(model, POINTS, data, out, **KW)
    m = read_manifest(out)
    assert s.status == "written" and m["rows"] == s.rows and s.shards == len(m["shards"]) > 3
    assert verify(out) == []
    ds = HarvestDataset(out)
    assert [sh["rows"] for sh in m["shards"]][:2] == [[0, 100], [100, 200]]
    checked = 0
    for k, shard in enumerate(ds.iter_shards()):
        assert shard["token_ids"].shape[0] == (100 if k < len(m["shards"]) - 1 else m["rows"] - 100 * k)
        for doc in shard["doc_index"].unique().tolist():
            sel = shard["doc_index"] == doc
            pos = shard["position"][sel].long()
            for start, ids in windows_of(model, DOCS[doc], KW["context"]):
                in_w = (pos >= start) & (pos < start + len(ids))
                if not in_w.any():
                    continue
                local = pos[in_w] - start
                _, ref = model.run_with_cache(torch.tensor([ids]), POINTS)
                assert shard["token_ids"][sel][in_w].tolist() == torch.tensor(ids)[local].tolist()
                for p in POINTS:
                    torch.testing.assert_close(shard[p][sel][in_w], ref[p][0, local])
                    checked += 1
    assert checked >= 3 * len(m["shards"])
    rows = all_rows(out)
    # every token of every non-empty document, once, in order
    want = [(d, i) for d, t in enumerate(DOCS) if t for i in range(len(model.tokenizer(t)["input_ids"]))]
    assert list(zip(rows["doc_index"].tolist(), rows["position"].tolist())) == want
    assert tuple(rows["z.0.head-1"].shape[1:]) == (model.d_model // model.config.num_attention_heads,)


def test_positions_last_and_bf16(model, data, tmp_path):
    out = tmp_path / "last"
    harvest(model, ["resid_post.-1"], data, out, positions="last", dtype="bf16", **KW)
    rows = all_rows(out)
    assert rows["doc_index"].tolist() == [d for d, t in enumerate(DOCS) if t]
    assert rows["resid_post.1"].dtype == torch.bfloat16
    for d, p, got in zip(rows["doc_index"].tolist(), rows["position"].tolist(), rows["resid_post.1"]):
        ids = model.tokenizer(DOCS[d])["input_ids"]
        assert p == len(ids) - 1
        _, ref = model.run_with_cache(torch.tensor([ids[-KW["context"]:]]), ["resid_post.1"])
        torch.testing.assert_close(got, ref["resid_post.1"][0, -1].to(torch.bfloat16))


def test_rerun_of_finished_harvest_writes_nothing_and_loads_nothing(model, data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    harvest(model, POINTS, data, out, **KW)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    def no_load(*a, **k):
        raise AssertionError("a finished harvest must not load the model")
    monkeypatch.setattr(runner, "load", no_load)
    s = harvest(LLAMA, POINTS, data, out, backend="eager", **KW)
    assert s.status == "complete" and s.rows == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_mixing_is_refused(model, data, tmp_path):
    out = tmp_path / "out"
    harvest(model, POINTS, data, out, **KW)
    for change, field in [(dict(points=["resid_post.0"]), "points"), (dict(dtype="bf16"), "dtype"),
                          (dict(model="openai-community/gpt2"), "model")]:
        kw = dict(dict(model=LLAMA, points=POINTS, data=data, out=out, backend="eager"), **KW)
        kw.update(change)
        with pytest.raises(MixingError, match=f"refusing to mix.*{field}: held"):
            harvest(**kw)
    # an unfinished part refuses too, before anything is loaded or written
    part = mf.part_dir(out, 0, 1) / mf.PART
    m = json.loads(part.read_text())
    m["complete"] = False
    part.write_text(json.dumps(m))
    (out / mf.MANIFEST).unlink()
    with pytest.raises(MixingError, match="dtype: held 'fp32', asked 'fp16'"):
        harvest(model, POINTS, data, out, **dict(KW, dtype="fp16"))
    with pytest.raises(MixingError, match="parts: held 1, asked 2"):
        harvest(model, POINTS, data, out, part=(0, 2), **KW)
    with mf.exclusive(part.parent), pytest.raises(MixingError, match="being harvested by another process"):
        harvest(model, POINTS, data, out, **KW)  # the same part started twice


def test_bad_input_errors(model, data, tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        harvest(model, POINTS, tmp_path / "nope.txt", tmp_path / "o1", **KW)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(InputError, match="is empty"):
        harvest(model, POINTS, tmp_path / "empty.txt", tmp_path / "o2", **KW)
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(InputError, match="no non-empty documents"):
        harvest(model, POINTS, tmp_path / "blank.txt", tmp_path / "o3", **KW)
    (tmp_path / "d.jsonl").write_text('{"body": "hello"}\n')
    with pytest.raises(InputError, match=r"no column 'text'.*\['body'\].*--text-field"):
        harvest(model, POINTS, tmp_path / "d.jsonl", tmp_path / "o4", **KW)
    (tmp_path / "d.csv").write_text("a\n")
    with pytest.raises(InputError, match="unknown suffix"):
        harvest(model, POINTS, tmp_path / "d.csv", tmp_path / "o5", **KW)
    with pytest.raises(AddressError, match="unknown point 'resid_pots'.*resid_post"):
        harvest(model, ["resid_pots.1"], data, tmp_path / "o6", **KW)
    with pytest.raises(AddressError, match="out of range"):
        harvest(model, ["resid_post.7"], data, tmp_path / "o6", **KW)
    with pytest.raises(PointError, match="attn_probs.0 cannot be harvested.*q.0 and k.0"):
        harvest(model, ["attn_probs.0"], data, tmp_path / "o6", **KW)
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp16, fp32"):
        harvest(model, POINTS, data, tmp_path / "o6", **dict(KW, dtype="int8"))
    with pytest.raises(ValueError, match="batch_tokens .* at least one context window"):
        harvest(model, POINTS, data, tmp_path / "o6", **dict(KW, batch_tokens=16))
    with pytest.raises(ValueError, match="0 <= index < count"):
        harvest(model, POINTS, data, tmp_path / "o6", part=(2, 2), **KW)
    assert not (tmp_path / "o6").exists()  # nothing is created for a refused run
    (tmp_path / "o7").mkdir()
    (tmp_path / "o7" / "notes.txt").write_text("mine")
    with pytest.raises(MixingError, match="not a harvest"):
        harvest(model, POINTS, data, tmp_path / "o7", **KW)
    with pytest.raises(FileNotFoundError, match="not a harvest output"):
        HarvestDataset(tmp_path / "o7")


def test_input_formats_give_the_same_rows(model, data, tmp_path):
    import datasets
    ref = tmp_path / "txt"
    harvest(model, ["resid_post.1"], data, ref, **KW)
    d = datasets.Dataset.from_dict({"body": DOCS})
    (tmp_path / "j").mkdir()
    d.to_json(tmp_path / "j" / "d.jsonl")
    d.to_parquet(tmp_path / "d.parquet")
    d.save_to_disk(tmp_path / "arrow")
    want = all_rows(ref)
    for src in (tmp_path / "j", tmp_path / "d.parquet", tmp_path / "arrow"):
        out = tmp_path / f"o-{src.name}"
        harvest(model, ["resid_post.1"], src, out, text_field="body", **KW)
        got = all_rows(out)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (src, k)


def test_two_parts_union_equals_one_part(model, data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    harvest(model, POINTS, data, one, **KW)
    s0 = harvest(model, POINTS, data, two, part=(0, 2), **KW)
    assert not s0.merged and not (two / mf.MANIFEST).exists()
    with pytest.raises(FileNotFoundError, match="unfinished harvest .1 of 2 parts"):
        HarvestDataset(two)
    s1 = harvest(model, POINTS, data, two, part=(1, 2), **KW)
    assert s1.merged and verify(two) == []
    a, b = all_rows(one), all_rows(two)
    m = read_manifest(two)
    for sh in m["shards"]:  # parts are disjoint: part i holds documents i, i + 2, ...
        part = int(sh["part"].split("-")[1])
        assert sh["docs"][0] % 2 == part and sh["docs"][1] % 2 == part
    order = sorted(range(len(b["doc_index"])), key=lambda i: (b["doc_index"][i], b["position"][i]))
    b = {k: v[order] for k, v in b.items()}
    for k in ("token_ids", "doc_index", "position"):
        assert torch.equal(a[k], b[k])
    for p in POINTS:
        torch.testing.assert_close(a[p], b[p])


def test_readers_torch_dataset_and_hf_datasets(model, data, tmp_path):
    out = tmp_path / "out"
    harvest(model, POINTS, data, out, **dict(KW, dtype="bf16"))
    rows = all_rows(out)
    ds = HarvestDataset(out, points=["resid_post.1"])
    assert len(ds) == len(rows["doc_index"])
    for i in (0, 99, 100, len(ds) - 1):
        item = ds[i]
        assert set(item) == {"token_ids", "doc_index", "position", "resid_post.1"}
        assert torch.equal(item["resid_post.1"], rows["resid_post.1"][i])
    with pytest.raises(KeyError, match="not in this harvest"):
        HarvestDataset(out, points=["resid_post.0"])
    stream = hf_dataset(out, streaming=True).with_format("torch")
    first = next(iter(stream))
    assert int(first["position"]) == 0 and first["z.0.head-1"].shape == rows["z.0.head-1"][0].shape
    full = hf_dataset(out, points=["resid_post.1"], cache_dir=str(tmp_path / "hf")).with_format("torch")
    assert len(full) == len(ds)
    torch.testing.assert_close(full[len(ds) - 1]["resid_post.1"], rows["resid_post.1"][-1].float())


def test_kill9_then_resume_equals_uninterrupted_byte_for_byte(model, tmp_path):
    data = tmp_path / "docs.txt"
    data.write_text("\n".join(LINES[:30]) + "\n")  # ~1600 tokens: 80 shards of 20 rows
    kw = dict(shard_tokens=20, context=32, batch_tokens=256)
    args = [sys.executable, "-m", "engine.harvest", LLAMA, "--backend", "eager", "--points", "resid_post.1,mlp_out.0",
            "--data", str(data), "--no-progress"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    ref, out = tmp_path / "ref", tmp_path / "out"
    harvest(model, ["resid_post.1", "mlp_out.0"], data, ref, progress=False, **kw)  # uninterrupted
    proc = subprocess.Popen(args + ["--out", str(out)], env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    part = mf.part_dir(out, 0, 1) / mf.PART
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(json.loads(part.read_text())["shards"]) >= 5:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.005)
    assert proc.poll() is None, "the harvest finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = json.loads(part.read_text())  # the manifest is always whole
    assert not killed["complete"] and not (out / mf.MANIFEST).exists()
    n_ref = len(read_manifest(ref)["shards"])
    assert 5 <= len(killed["shards"]) < n_ref
    for sh in killed["shards"]:  # every listed shard is complete and is the reference's shard
        assert (part.parent / sh["file"]).read_bytes() == (mf.part_dir(ref, 0, 1) / sh["file"]).read_bytes()
    kept = {sh["file"]: (part.parent / sh["file"]).stat().st_mtime_ns for sh in killed["shards"]}
    r = subprocess.run(args + ["--out", str(out)], env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # resumed after the last complete shard: the shards it had were not rewritten
    assert {f: (part.parent / f).stat().st_mtime_ns for f in kept} == kept
    a, b = tree(ref), tree(out)
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(".json"):
            assert strip(json.loads(a[name])) == strip(json.loads(b[name])), name
        else:
            assert a[name] == b[name], name


def test_cli_errors(tmp_path, capsys):
    from engine.harvest.__main__ import main
    assert main([LLAMA, "--data", str(tmp_path / "x.txt"), "--out", str(tmp_path / "o"), "--points", "x.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: input") and "does not exist" in err
    assert main([LLAMA, "--data", str(SAMPLE)]) == 2
    assert "--points, --out required" in capsys.readouterr().err
    assert main([LLAMA, "--points", "resid_post.0", "--data", str(SAMPLE), "--out", str(tmp_path / "o"),
                 "--part", "1/2", "--workers", "2"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([LLAMA, "--points", "resid_post.0", "--data", str(SAMPLE), "--out", str(tmp_path / "o"),
                 "--part", "one"]) == 2
    assert "--part takes I/N" in capsys.readouterr().err
    assert main(["merge", str(tmp_path)]) == 2 and "holds no harvest parts" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_workers_split_disjoint_parts_and_merge(model, tmp_path):
    base = [sys.executable, "-m", "engine.harvest"]
    data = tmp_path / "d.txt"
    data.write_text("\n".join(LINES[:9]) + "\n")
    out = tmp_path / "w"
    args = [LLAMA, "--backend", "eager", "--points", "resid_post.1", "--data", str(data), "--out", str(out),
            "--shard-tokens", "50", "--no-progress"]
    r = subprocess.run(base + args + ["--workers", "2"], env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = read_manifest(out)
    assert {sh["part"] for sh in m["shards"]} == {"part-00000-of-00002", "part-00001-of-00002"}
    assert m["rows"] == sum(len(model.tokenizer(t)["input_ids"]) for t in LINES[:9]) == m["shards"][-1]["rows"][1]
    for sh in m["shards"]:
        assert {d % 2 for d in sh["docs"]} == {int(sh["part"][5:10])}
    assert verify(out) == []
    r = subprocess.run(base + ["merge", str(out)], env=env(), capture_output=True, text=True)
    assert r.returncode == 0 and "merged" in r.stdout


def _peak_rss(args: list[str]) -> float:
    """Peak RSS (bytes) of a harvest subprocess, read from its own /proc status at exit."""
    code = ("import sys, runpy; sys.argv = ['engine.harvest'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('engine.harvest', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('HWM', [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    r = subprocess.run([sys.executable, "-c", code, *args], env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split("HWM")[-1].split()[0]) * 1024


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_dataset(tmp_path):
    """10 shards' worth of data vs 1: the extra peak memory stays under a few shards (the buffer being
    filled, the writer's queue and the shard being serialized), where keeping rows would add 9 shards."""
    shard = 4096
    points = "resid_post,mlp_act,mlp_pre"  # gpt2 twin: 2 x (128 + 512 + 512) floats = 9 KiB per row
    shard_bytes = shard * 2 * (128 + 512 + 512) * 4
    tok = load_model("openai-community/gpt2", source="zoo").tokenizer
    n_tok, one, ten = 0, [], []
    for line in LINES * 200:
        n = len(tok(line)["input_ids"])
        if n_tok < shard:
            one.append(line)
        ten.append(line)
        n_tok += n
        if n_tok >= 10 * shard:
            break
    assert n_tok >= 10 * shard
    (tmp_path / "one.txt").write_text("\n".join(one) + "\n")
    (tmp_path / "ten.txt").write_text("\n".join(ten) + "\n")
    common = ["openai-community/gpt2", "--backend", "eager", "--points", points, "--shard-tokens", str(shard),
              "--context", "64", "--batch-tokens", "1024", "--no-progress"]
    rss1 = _peak_rss(common + ["--data", str(tmp_path / "one.txt"), "--out", str(tmp_path / "o1")])
    rss10 = _peak_rss(common + ["--data", str(tmp_path / "ten.txt"), "--out", str(tmp_path / "o10")])
    assert len(read_manifest(tmp_path / "o10")["shards"]) >= 10
    assert rss10 / rss1 < 1.3, (rss1, rss10)
    assert rss10 - rss1 < 5 * shard_bytes, ((rss10 - rss1) / shard_bytes, "shards of growth")


def test_batches_rebuilt_from_any_cursor_are_the_uninterrupted_ones(model):
    from engine.harvest import batches
    docs = list(enumerate(DOCS))
    full = list(batches.pack(batches.windows(docs, model.tokenizer, 32), 128))
    assert len(full) > 4 and all(b.tokens <= 128 for b in full)
    for k, b in enumerate(full):
        for cur in (b.start, full[k - 1].end if k else b.start):
            tail = list(batches.pack(batches.windows(docs, model.tokenizer, 32, start=cur), 128))
            assert [[(w.doc, w.index) for w in x.windows] for x in tail] == \
                   [[(w.doc, w.index) for w in x.windows] for x in full[k:]]


def test_prefetch_keeps_order_and_raises_the_producers_error():
    from engine.harvest.batches import prefetch
    assert list(prefetch(iter(range(50)), depth=2)) == list(range(50))

    def broken():
        yield 1
        raise OSError("disk read failed")
    it = prefetch(broken())
    assert next(it) == 1
    with pytest.raises(OSError, match="disk read failed"):
        next(it)
