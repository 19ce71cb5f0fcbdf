"""Map a key path of a recipe to the line it was written on, from PyYAML's node tree.

`yaml.safe_load` throws positions away, so the loader composes the document first (`yaml.compose`
keeps each node's `start_mark`) and this module records, for every key and list item, the 1-based line
it starts on. A path that is not in the file (a missing key, a value from `--set`) is reported at its
nearest ancestor that is, which is where the user has to add or change something.
"""

from __future__ import annotations

import yaml

from llmopt.recipe.issues import Issue, KeyPath

MERGE_KEY = "<<"


class LineMap:
    """Key path -> 1-based line, plus the duplicate and non-string keys met while building it."""

    def __init__(self, root: yaml.Node | None):
        self._lines: dict[KeyPath, int] = {}
        self.problems: list[Issue] = []
        if root is not None:
            self._lines[()] = root.start_mark.line + 1
            self._walk(root, ())

    def line(self, path: KeyPath) -> int | None:
        """The line of `path`, or of its nearest ancestor written in the file."""
        for n in range(len(path), -1, -1):
            if path[:n] in self._lines:
                return self._lines[path[:n]]
        return None

    def has(self, path: KeyPath) -> bool:
        return path in self._lines

    def _walk(self, node: yaml.Node, path: KeyPath) -> None:
        if isinstance(node, yaml.MappingNode):
            self._mapping(node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._lines[(*path, i)] = item.start_mark.line + 1
                self._walk(item, (*path, i))

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> None:
        seen: dict[str, int] = {}
        merged: list[yaml.Node] = []
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:merge":
                merged.append(value_node)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.problems.append(Issue("keys must be plain names, not lists or mappings", path, line=line))
                continue
            key = key_node.value
            if key in seen:
                self.problems.append(Issue(f"duplicate key {key!r} (first written on line {seen[key]})",
                                           (*path, key), line=line))
                continue
            seen[key] = line
            self._lines[(*path, key)] = line
            self._walk(value_node, (*path, key))
        # `<<: *anchor` merges keys the mapping does not set itself; they live where the anchor is
        for value in merged:
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            for src in sources:
                if not isinstance(src, yaml.MappingNode):
                    continue
                for key_node, value_node in src.value:
                    key = str(key_node.value)
                    if key not in seen:
                        seen[key] = key_node.start_mark.line + 1
                        self._lines[(*path, key)] = seen[key]
                        self._walk(value_node, (*path, key))
