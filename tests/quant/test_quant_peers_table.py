"""The pure parts of benchmarks/peers/quant_peers.py: the table it prints and where --write-doc puts it."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/peers"))

import peers_plan as pp  # noqa: E402
import quant_peers as qp  # noqa: E402


def test_table_gives_change_and_share_of_our_rtn_damage():
    results = {"domains": {"wikitext2": {}, "tinyshakespeare": {}}, "rows": {
        "fp32": {"ppl": {"wikitext2": 20.0, "tinyshakespeare": 40.0}},
        "llmopt RTN": {"ppl": {"wikitext2": 30.0, "tinyshakespeare": 50.0}, "wall_s": 3.1, "size_mb": 90.0},
        "llmopt GPTQ act-order": {"ppl": {"wikitext2": 25.0}, "wall_s": 700}}}
    lines = qp.render(results).splitlines()
    assert lines[0].count("share of llmopt RTN Δ") == 2 and len(lines) == 5
    assert lines[3] == "| llmopt RTN | 30.000 | +50.0% | 1.00 | 50.000 | +25.0% | 1.00 | 3.1 | 90.0 |"
    assert lines[4] == "| llmopt GPTQ act-order | 25.000 | +25.0% | 0.50 |  |  |  | 700 |  |"


def test_write_doc_replaces_only_its_own_block_in_quantize_md():
    doc = "# Q\n\n### Against llm-compressor\n\nprotocol\n\n## Gemma 3\n\ng\n"
    once = pp.replace_doc_section(doc, "| t1 |", "### Against llm-compressor", qp.DOC_MARKERS)
    begin, end = qp.DOC_MARKERS
    assert once == f"# Q\n\n### Against llm-compressor\n\nprotocol\n\n{begin}\n| t1 |\n{end}\n\n## Gemma 3\n\ng\n"
    assert pp.replace_doc_section(once, "| t2 |", "### Against llm-compressor", qp.DOC_MARKERS) == \
        once.replace("| t1 |", "| t2 |")
    assert begin in qp.DOC.read_text() and end in qp.DOC.read_text()  # the shipped doc has the block
