"""Calibration data: every local format through `datasets`, weights, dedupe, seeded sampling, packing
and the eval-overlap rule."""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline_helpers import KB_CALIB

from llmopt.calibrate.overlap import build_eval_index, find_overlaps
from llmopt.calibrate.run import CalibrationDataConfig, sample_windows
from llmopt.calibrate.sources import DataSource, load_texts
from llmopt.calibrate.windows import allocate, build_calibration_set, dedupe
from llmopt.errors import LlmoptError
from llmopt.testing.tiny_model import build_tokenizer

DOCS = [f"Document {i}: the quick brown fox number {i} jumps over {i * 7} lazy dogs near river {i % 5}. " * 3
        for i in range(40)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture()
def corpus(tmp_path):
    """The same 40 documents as jsonl, csv, parquet and a directory of .txt files."""
    import pandas as pd

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    pd.DataFrame({"text": DOCS}).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame({"text": DOCS}).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(d + "\nsecond line\n")
    return tmp_path


def test_every_local_format_reads_the_same_texts(corpus):
    for name in ("d.jsonl", "d.csv", "d.parquet"):
        assert load_texts(DataSource(path=str(corpus / name))) == DOCS
    txt = load_texts(DataSource(path=str(corpus / "txt")))
    assert len(txt) == len(DOCS) and txt[0] == DOCS[0] + "\nsecond line\n"  # one document per file


def test_source_spec_weight_and_errors(corpus, monkeypatch):
    assert DataSource.parse("a/b.jsonl:2.5") == DataSource(path="a/b.jsonl", weight=2.5)
    assert DataSource.parse("wikitext").weight == 1.0
    for bad in ("a/b.txt:0", "a/b.txt:-1", "a/b.txt:nan", "a/b.txt:inf"):
        with pytest.raises(LlmoptError, match="weight after ':' must be a positive number"):
            DataSource.parse(bad)
    (corpus / "odd.txt:0").write_text("a file whose name ends in :0")
    assert DataSource.parse(str(corpus / "odd.txt:0")) == DataSource(path=str(corpus / "odd.txt:0"))
    (corpus / "x.bin").write_text("?")
    with pytest.raises(LlmoptError, match="unknown data format"):
        load_texts(DataSource(path=str(corpus / "x.bin")))
    (corpus / "bad.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(LlmoptError, match="no text column"):
        load_texts(DataSource(path=str(corpus / "bad.jsonl")))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LlmoptError, match="not a local path.*offline"):
        load_texts(DataSource(path="no-such-org/no-such-dataset"))


def test_dedupe_and_allocate():
    out, dups = dedupe(["a b", "a  b\n", "c"], set())
    assert out == ["a b", "c"] and dups == 1
    assert allocate(10, [1, 1, 1]) == [4, 3, 3]
    assert allocate(128, [3, 1]) == [96, 32]


def test_windows_are_reproducible_mixed_and_packed(corpus, tok):
    srcs = [DataSource(path=str(corpus / "d.jsonl"), weight=3), DataSource(path=str(corpus / "txt"), weight=1)]
    a = build_calibration_set(srcs, tok, num_samples=8, seq_len=32, seed=1)
    b = build_calibration_set(srcs, tok, num_samples=8, seq_len=32, seed=1)
    c = build_calibration_set(srcs, tok, num_samples=8, seq_len=32, seed=2)
    assert a.windows.shape == (8, 32) and a.per_source == {srcs[0].path: 6, srcs[1].path: 2}
    assert (a.windows == b.windows).all() and not (a.windows == c.windows).all()
    # the same documents in another source are duplicates
    dup = build_calibration_set([srcs[0], DataSource(path=str(corpus / "d.csv"))], tok, 4, 32)
    assert dup.num_duplicates == len(DOCS)


def test_windows_do_not_depend_on_where_the_checkout_lives(corpus, tok, tmp_path):
    """The same file under another directory gives the same windows (CI clones elsewhere)."""
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "d.jsonl").write_bytes((corpus / "d.jsonl").read_bytes())
    a = build_calibration_set([DataSource(path=str(corpus / "d.jsonl"))], tok, num_samples=6, seq_len=32)
    b = build_calibration_set([DataSource(path=str(moved / "d.jsonl"))], tok, num_samples=6, seq_len=32)
    assert torch.equal(a.windows, b.windows)


def test_too_little_data_warns_and_uses_what_there_is(corpus, tok):
    cs = build_calibration_set([DataSource(path=str(corpus / "d.jsonl"))], tok, num_samples=10_000, seq_len=64)
    assert 0 < cs.windows.shape[0] < 10_000
    assert "windows of 64 tokens available" in cs.warnings[0]
    with pytest.raises(LlmoptError, match="no window"):
        build_calibration_set([DataSource(path=str(corpus / "d.jsonl"))], tok, 4, seq_len=100_000)


def test_eval_overlap_is_an_error_unless_allowed(corpus, tok, tmp_path):
    base = CalibrationDataConfig(data=[str(corpus / "d.jsonl")], num_samples=40, seq_len=32)
    first = tok.decode(sample_windows(base, tok).windows[0].tolist())
    leaked = " ".join(first.split()[2:12])  # ten words the windows certainly contain
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps({"question": leaked, "choices": ["x"], "answer": 0}) + "\n")
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"question": "What colour is the sky over Tallinn in winter?",
                                 "context": "Nothing from the corpus at all, nothing at all."}) + "\n")
    cfg = base.model_copy(update={"eval_data": [str(ev)]})
    with pytest.raises(LlmoptError, match="overlap the eval data"):
        sample_windows(cfg, tok)
    cs = sample_windows(cfg.model_copy(update={"allow_overlap": True}), tok)
    assert any("overlap" in w for w in cs.warnings)
    assert sample_windows(cfg.model_copy(update={"eval_data": [str(clean)]}), tok).warnings == []
    # a verbatim context is caught too, and plain-text eval files by 8-grams
    index = build_eval_index([str(corpus / "txt" / "05.txt")])
    assert find_overlaps([DOCS[5]], index) and not find_overlaps(["unrelated words " * 5], index)
    ctx = tmp_path / "ctx.jsonl"
    ctx.write_text(json.dumps({"context": "over 21 lazy dogs", "question": "q?"}) + "\n")
    assert find_overlaps([DOCS[3]], build_eval_index([str(ctx)]))


def test_a_directory_source_skips_files_without_a_text_column(corpus):
    d = corpus / "mixed"
    d.mkdir()
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:5]))
    (d / "eval.jsonl").write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n")
    warned: list[str] = []
    assert load_texts(DataSource(path=str(d)), warn=warned.append) == DOCS[:5]
    assert len(warned) == 1 and "eval.jsonl: no text column" in warned[0] and "skipped" in warned[0]
    with pytest.raises(LlmoptError, match=r"eval\.jsonl: no text column \(looked for text, content, document; "
                                          r"found answer, question\)"):
        load_texts(DataSource(path=str(d / "eval.jsonl")))  # named on its own: still an error
    (d / "docs.jsonl").unlink()
    with pytest.raises(LlmoptError, match="none of its 1 data files has a text column"):
        load_texts(DataSource(path=str(d)), warn=warned.append)


def test_the_shipped_calibration_data_folder_is_a_usable_source(capsys):
    """calibration_data/ keeps the eval sets (kb_gen, kb_mc: no text column) next to the texts."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "calibration_data"
    texts = load_texts(DataSource(path=str(folder)))
    err = capsys.readouterr().err
    assert "kb_gen.jsonl: no text column" in err and "kb_mc.jsonl: no text column" in err
    assert "kb_calibration.jsonl" not in err and len(texts) > 300


@pytest.mark.parametrize("cmd, flag", [("quantize", "--calib-data"), ("calibrate", "--data")])
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_two_paths_after_one_flag_say_to_repeat_it(tiny_llama, tmp_path, monkeypatch, capsys, cmd, flag, with_model):
    """Typer options take one value: `FLAG A B` leaves B over (or takes it as MODEL when none is given)."""
    from tests.cli_runner import run_cli

    a, b = str(KB_CALIB), str(KB_CALIB.parent / "general_prose.jsonl")
    model = [str(tiny_llama)] if with_model else []
    scheme = ["--scheme", "w8a8"] if cmd == "quantize" else []
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, cmd, *model, *scheme, flag, a, b, "-o", str(out))
    assert code == 2 and "Traceback" not in err and err.strip().count("\n") == 0, err
    assert f"unexpected extra argument {b!r}" in err and f"({flag} {a} {flag} {b})" in err
    assert not out.exists()


def test_calibrate_on_the_shipped_folder_skips_the_eval_sets(tiny_llama, tmp_path, monkeypatch, capsys):
    from tests.cli_runner import run_cli

    out = tmp_path / "calib"
    code, stdout, err = run_cli(monkeypatch, capsys, "calibrate", str(tiny_llama), "--data", str(KB_CALIB.parent),
                                "--num-samples", "2", "--seq-len", "32", "--device", "cpu", "-o", str(out))
    assert code == 0, err
    assert "kb_gen.jsonl: no text column" in err and "skipped" in err
    assert (out / "manifest.json").is_file() and "calibrated on 2 windows" in stdout
