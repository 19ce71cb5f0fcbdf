"""The memory plan (`VramPlan.to_json()`, a recipe's `vram_plan/plan.json`) as a section of an HTML report:
the bill per GPU as a bar against the GPU's memory, the numbers behind it and the recommendations."""

from __future__ import annotations

from typing import Any

from llmopt.report.figures import stacked_bar_svg
from llmopt.report.html import Section, bullet_list, figure, paragraph, table
from llmopt.units import format_bytes

_GIB = float(1 << 30)


def plan_section(plan: dict[str, Any], section_id: str = "memory-plan") -> Section:
    s = Section(section_id, "Memory plan")
    fits = "fits" if plan.get("fits") else "does NOT fit"
    s.add(paragraph(f"{plan.get('model') or 'model'}: {plan['batch']} sequence(s) of {plan['seq_len']:,} tokens, "
                    f"weights {plan['weight_dtype']}, KV cache {plan['kv_dtype']}, on one GPU of "
                    f"{format_bytes(plan['gpu_memory_bytes'])}: {fits}; at most {plan['max_concurrent_sequences']:,} "
                    "sequences of that length at once."))
    parts = [("weights", plan["weights_bytes"]), ("KV cache", plan["kv_bytes_total"]),
             ("activations", plan["activation_bytes"]), ("reserve", plan["reserve_bytes"])]
    svg = stacked_bar_svg(f"{section_id}-bar", [(k, v / _GIB) for k, v in parts], plan["gpu_memory_bytes"] / _GIB,
                          "GiB", "memory per GPU")
    s.add(figure(svg, "What one GPU holds (weights, the KV cache of the batch, the activation peak, the framework "
                 "reserve) against its memory (red line).", f"fig-{section_id}"))
    rows = [[k, format_bytes(v)] for k, v in parts]
    rows += [["total", format_bytes(plan["total_bytes"])], ["GPU memory", format_bytes(plan["gpu_memory_bytes"])],
             ["free", format_bytes(plan["free_bytes"])],
             ["KV per token", format_bytes(plan["kv_bytes_per_token"])],
             ["parameters", f"{plan['params']:,}"]]
    s.add(table(["", "bytes"], rows, numeric=(1,)))
    par = plan.get("parallel")
    if par:
        s.add(paragraph(f"With {par.get('num_gpus')} GPUs: see plan.json for the tensor/pipeline/data-parallel "
                        "layouts."))
    recs = plan.get("recommendations") or []
    if recs:
        s.add(paragraph("Recommendations, in OOM-checklist order:"),
              bullet_list([f"{r['action']} (saves {format_bytes(r['saves_bytes'])}, then "
                           f"{'fits' if r['fits_after'] else 'still does not fit'})" for r in recs]))
    for w in plan.get("warnings") or []:
        s.add(paragraph(f"warning: {w}", "note"))
    return s
