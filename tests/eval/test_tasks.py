"""lm-eval task YAMLs: templates, prompts, tokenization of pairs and metric definitions, as lm-eval has them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from eval_helpers import write_task

from llmopt.errors import LlmoptError
from llmopt.eval.loglikelihood import Scored, encode_pair
from llmopt.eval.metrics import exact_match, mean_stderr, multiple_choice_scores
from llmopt.eval.tasks import load_task
from llmopt.eval.templates import DocRenderer
from llmopt.testing.tiny_model import build_tokenizer

ROOT_TASKS = ("calibration_data/kb_mc.yaml", "calibration_data/kb_gen.yaml")


def test_renderer_follows_lm_eval_conversions():
    doc = {"q": "Why?", "choices": ["a", "b"], "answer": 1, "label": "b", "gold": [0, 1]}
    r = DocRenderer("t", "Q: {{q}}\n", "{{answer}}", "{{choices}}")
    assert r.doc_to_text(doc) == "Q: Why?\n"  # keep_trailing_newline
    assert r.doc_to_target(doc) == 1  # digits become an int index when there are choices
    assert r.doc_to_choice(doc) == ["a", "b"]  # rendered list literal, ast.literal_eval'ed
    assert DocRenderer("t", "q", "label", "choices").doc_to_target(doc) == "b"  # a field name
    assert DocRenderer("t", "q", "{{gold}}", None).doc_to_target(doc) == [0, 1]  # bracketed -> list
    assert DocRenderer("t", "q", "{{answer}}", None).doc_to_target(doc) == "1"  # no choices: stays a string
    assert DocRenderer("t", "q", 3, ["x", "y"]).doc_to_target(doc) == 3
    assert DocRenderer("t", "{{ q | regex_replace('[?]', '!') }}", "answer", None).doc_to_text(doc) == "Why!"
    with pytest.raises(LlmoptError, match="doc_to_text"):
        DocRenderer("t", "{{missing}}", "answer", None).doc_to_text(doc)  # StrictUndefined
    with pytest.raises(LlmoptError, match="bad template in doc_to_target"):
        DocRenderer("t", "q", "{{answer", None)


def test_kb_tasks_load_and_render():
    mc = load_task(ROOT_TASKS[0])
    assert mc.name == "kb_mc" and len(mc.docs) == 100 and [m.metric for m in mc.metrics] == ["acc", "acc_norm"]
    r = mc.requests(limit=2)
    assert len(r) == 2
    assert r[0].context.startswith("Context: Larkspur Labs is a software company")
    assert r[0].context.endswith("\nAnswer:")
    assert r[0].continuations == [" About 120", " About 1,500", " About 420", " About 4,200"]
    assert r[0].gold == 2
    gen = load_task(ROOT_TASKS[1])
    g = gen.requests(limit=1)[0]
    assert g.gold == "Monday" and g.context.endswith("Question: On which day of the week is the on-call handoff?\nAnswer:")
    assert gen.generation["until"] == ["\n", "."] and gen.generation["max_gen_toks"] == 16


def test_fewshot_context_matches_lm_eval_layout(tmp_path):
    task = load_task(write_task(tmp_path, num_fewshot=2, fewshot_config={"sampler": "first_n"},
                                description="Answer the questions.\n\n"))
    r = task.requests(limit=1)[0]
    d = [task.docs[0], task.docs[1]]
    shots = "".join(f"Context: {x['context']}\nQuestion: {x['question']}\nAnswer: {x['choices'][x['answer']]}\n\n"
                    for x in d)
    assert r.context == "Answer the questions.\n\n" + shots + "Context: " + d[0]["context"] + \
        f"\nQuestion: {d[0]['question']}\nAnswer:"
    # the default sampler draws with random.Random(1234), one stream across documents
    import random

    rnd = random.Random(1234)
    task = load_task(write_task(tmp_path, name="rnd", num_fewshot=1))
    for req in task.requests(limit=3):
        shot = rnd.sample(task.docs, 1)[0]
        assert req.context.startswith(f"Context: {shot['context']}\nQuestion: {shot['question']}\nAnswer: ")


def test_encode_pair_moves_trailing_space_to_continuation():
    tok = build_tokenizer()
    ctx, cont = encode_pair(tok, "The quick brown ", "fox")
    whole = tok.encode("The quick brown fox")
    assert ctx + cont == whole and ctx == tok.encode("The quick brown")
    ctx2, cont2 = encode_pair(tok, "The quick brown", " fox")
    assert (ctx2, cont2) == (ctx, cont)
    empty_ctx, c = encode_pair(tok, "", " fox")
    assert empty_ctx == [tok.bos_token_id] and c == tok.encode(" fox", add_special_tokens=False)


def test_metric_definitions():
    lls = [Scored(-4.0, False, 2), Scored(-5.0, False, 3), Scored(-9.0, False, 1)]
    choices = ["ab", "abcdefghij", "a"]
    # acc: raw argmax (0); acc_norm: per character -2, -0.5, -9 -> 1; acc_bytes the same here
    assert multiple_choice_scores(lls, choices, 1) == {"acc": 0.0, "acc_norm": 1.0, "acc_bytes": 1.0}
    assert multiple_choice_scores(lls, choices, [0, 2])["acc"] == 1.0
    # acc_norm counts characters, acc_bytes UTF-8 bytes
    s = multiple_choice_scores([Scored(-3.3, False, 1), Scored(-4.0, False, 1)], ["ééé", "abcd"], 1)
    assert (s["acc_norm"], s["acc_bytes"]) == (1.0, 0.0)
    assert exact_match(" Monday.", "monday", ignore_case=True, ignore_punctuation=True,
                       regexes_to_ignore=[r"^\s+", r"\s+$"]) == 1.0
    assert exact_match(" Monday", "Monday") == 0.0  # lm-eval does not strip whitespace by itself
    assert exact_match("10:00", "1000", ignore_punctuation=True) == 1.0
    assert exact_match("x", ["y", "x"]) == 1.0
    xs = [1.0, 0.0, 1.0, 1.0]
    assert mean_stderr(xs) == pytest.approx(np.std(xs, ddof=1) / math.sqrt(4))
    assert math.isnan(mean_stderr([1.0]))


@pytest.mark.parametrize("override, message", [
    ({"dataset_kwargs": {"data_files": {"test": "nope.jsonl"}}}, "does not exist"),
    ({"doc_to_txet": "x"}, "unknown field 'doc_to_txet'"),
    ({"doc_to_text": "{{ context"}, "bad template in doc_to_text"),
    ({"doc_to_text": "{{ contxt }}"}, "cannot render doc_to_text"),
    ({"process_docs": "x"}, "field 'process_docs' is an lm-eval feature llmopt does not support"),
    ({"output_type": "loglikelihood_rolling"}, "field output_type"),
    ({"metric_list": [{"metric": "f1"}]}, "metric 'f1' is not supported"),
    ({"dataset_path": "hellaswag"}, "field dataset_path"),
    ({"test_split": "validation"}, "split 'validation' is not in data_files"),
    ({"num_fewshot": -2}, "field num_fewshot: Input should be greater than or equal to 0"),
])
def test_bad_task_files_are_one_line_errors(tmp_path, override, message):
    path = write_task(tmp_path, **override)
    with pytest.raises(LlmoptError, match=message) as e:
        load_task(path)
    assert "\n" not in str(e.value)


def test_function_tags_and_includes(tmp_path):
    base = write_task(tmp_path, name="base")
    (tmp_path / "child.yaml").write_text(f"include: {base.name}\ntask: child\ntarget_delimiter: ' '\n")
    child = load_task(tmp_path / "child.yaml")
    assert child.name == "child" and len(child.docs) == len(child.docs)
    (tmp_path / "fn.yaml").write_text(f"include: {base.name}\nprocess_docs: !function utils.process\n")
    with pytest.raises(LlmoptError, match="process_docs uses !function"):
        load_task(tmp_path / "fn.yaml")


def test_document_without_choices_is_named(tmp_path):
    """An empty choice list used to reach argmax (a traceback after the model ran); now one line names it."""
    path = write_task(tmp_path)
    docs = [json.loads(x) for x in (tmp_path / "tiny_mc.jsonl").read_text().splitlines()]
    docs[2]["choices"] = []
    (tmp_path / "tiny_mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = load_task(path)
    assert len(task.requests(limit=2)) == 2  # the documents --limit leaves out are not judged
    with pytest.raises(LlmoptError, match=r"^task tiny_mc: document 2 has no choices$"):
        task.requests()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_gen_toks": 0}, "field generation_kwargs.max_gen_toks: Input should be greater than or equal to 1"),
    ({"max_gen_toks": "16"}, "field generation_kwargs.max_gen_toks: Input should be a valid integer"),
    ({"temperature": -1}, "field generation_kwargs.temperature: Input should be greater than or equal to 0"),
    ({"do_sample": "false"}, "field generation_kwargs.do_sample: Input should be a valid boolean"),
    ({"top_p": 0}, "field generation_kwargs.top_p: Input should be greater than 0"),
    ({"until": 5}, "field generation_kwargs.until: Input should be a valid string"),
    ({"until": ["\n", 3]}, "field generation_kwargs.until: "),
])
def test_bad_generation_kwargs_are_named_when_the_task_loads(tmp_path, kwargs, message):
    """They were refused by the engine after the model loaded, naming neither the task nor the field."""
    path = write_task(tmp_path, name="g0", generate=True)
    cfg = yaml.safe_load(path.read_text())
    cfg["generation_kwargs"].update(kwargs)
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(LlmoptError) as e:
        load_task(path)
    assert str(e.value).startswith(f"task file {path}: {message}"), str(e.value)


@pytest.mark.parametrize("text, line", [
    ('{"a": 1}\n\n{"a": 2}\n{"a": 3,}\n', 4),  # JSON lines: the file's line, blank lines counted
    ('{"a": "x\u2028y"}\n{"a": }\n', 2),  # a line separator inside a string does not end the line
    ('[{"a": 1},\n {"a": 2},\n {"a": }]\n', 3),  # a JSON array: its own line numbers
])
def test_bad_json_names_the_files_line(tmp_path, text, line):
    """The line used to be the one inside the record (always 1 for JSON lines)."""
    path = write_task(tmp_path)
    (tmp_path / "tiny_mc.jsonl").write_text(text, encoding="utf-8")
    with pytest.raises(LlmoptError) as e:
        load_task(path)
    assert str(e.value).startswith(f"{tmp_path / 'tiny_mc.jsonl'}:{line}: invalid JSON ("), str(e.value)
