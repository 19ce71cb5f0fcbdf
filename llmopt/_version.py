"""The package version, in a module of its own: llmopt's modules import it from here, never from the
package root, so importing any of them never runs `llmopt/__init__.py` for a name (no hidden cycle)."""

__version__ = "0.1.0"
