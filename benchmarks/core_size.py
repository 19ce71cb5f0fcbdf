"""Issue #16's size check: the engine core (engine + layers + models) like for like with the 2,784 lines
it had when the issue was filed, as one command over git history.

    python benchmarks/core_size.py [--base fa71cc6]

Later issues added whole files (model families, structured outputs, our C kernels' wrappers) and code
inside the core's own files (MoE and sliding-window config, prompt logprobs, the native-op dispatch).
Neither was there to compare against, so: like for like = the lines at filing + what #16's own commits
(their messages say "#16") changed in the files that are not another issue's. Files another issue
created are listed in OTHER_ISSUES_FILES; their lines are reported, not counted.
"""

from __future__ import annotations

import argparse
import subprocess

DIRS = ("llmopt/engine", "llmopt/layers", "llmopt/models")
OTHER_ISSUES_FILES = {  # created by later issues: families (#14), structured outputs (#15), speed (#17)
    "llmopt/models/gemma3.py", "llmopt/models/moe.py", "llmopt/models/registry.py", "llmopt/layers/moe.py",
    "llmopt/engine/hybrid_block_manager.py", "llmopt/layers/attention/grouped_kv_cache.py",
    "llmopt/engine/structured_output.py", "llmopt/engine/argmax.py", "llmopt/layers/packed_linear.py",
    "llmopt/layers/native_ops.py", "llmopt/layers/attention/paged_decode_kernel.py",
}
EXTRA_16 = {"fc0dd9b", "ceaa721"}  # #16 commits whose messages do not say so (spec_decode / sequence fixes)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def py_lines(rev: str) -> dict[str, int]:
    files = [f for f in git("ls-tree", "-r", "--name-only", rev, *DIRS).split() if f.endswith(".py")]
    return {f: git("show", f"{rev}:{f}").count("\n") for f in files}


def delta(rev: str) -> tuple[int, int]:
    """(core, other-issue files) lines a first-parent commit added net."""
    core = other = 0
    for row in git("diff", "--numstat", f"{rev}^1", rev, "--", *DIRS).splitlines():
        added, removed, path = row.split("\t")
        if path.endswith(".py") and added != "-":
            if path in OTHER_ISSUES_FILES:
                other += int(added) - int(removed)
            else:
                core += int(added) - int(removed)
    return core, other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="fa71cc6", help="the commit #16 was filed at")
    args = ap.parse_args()
    base = sum(py_lines(args.base).values())
    now = py_lines("HEAD")
    ours = others = 0
    for rev in git("rev-list", "--first-parent", f"{args.base}..HEAD").split():
        core, _ = delta(rev)
        if "#16" in git("log", "-1", "--format=%B", rev) or rev[:7] in EXTRA_16:
            ours += core
        else:
            others += core
    core_now = sum(n for f, n in now.items() if f not in OTHER_ISSUES_FILES)
    print(f"engine + layers + models at {args.base}: {base} lines; at HEAD: {sum(now.values())}")
    print(f"  in files later issues created: {sum(now.values()) - core_now}")
    print(f"  in the core's files: {core_now} = {base} {ours:+d} (#16's commits) {others:+d} (other issues')")
    print(f"like for like: {base + ours} (target: under 2,784); llm_engine.py: "
          f"{now.get('llmopt/engine/llm_engine.py', 0)} lines (target: under 250)")


if __name__ == "__main__":
    main()
