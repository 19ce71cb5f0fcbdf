"""Self-contained HTML reports: one file, inline CSS and SVG figures, no script and nothing fetched.

A leaf below the commands: `eval`, `bench`, `planning` and `recipe` build their sections with it, and it
imports none of them (tests/test_layering.py).
"""
