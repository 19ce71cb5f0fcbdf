"""Reading an HTML report back with the standard library's parser: what the report tests check."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
EXTERNAL = {"script", "link", "img", "iframe", "object", "embed", "audio", "video", "source", "image", "use"}


@dataclass
class Page:
    title: str = ""
    sections: dict[str, str] = field(default_factory=dict)  # id -> h2 text
    figures: dict[str, int] = field(default_factory=dict)  # figure id -> <svg> elements inside it
    verdicts: list[str] = field(default_factory=list)  # PASS / NOT SHOWN / FAIL cells, in order
    tables: int = 0
    text: str = ""
    external: list[str] = field(default_factory=list)  # anything that could load a resource
    ids: list[str] = field(default_factory=list)


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self.stack: list[str] = []
        self.section: str | None = None
        self.figure: str | None = None
        self.capture: str | None = None  # "title", "h2" or "verdict"
        self.buf: list[str] = []
        self.chunks: list[str] = []

    def _check(self, tag: str, attrs: list[tuple[str, str | None]]) -> dict[str, str]:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.page.ids.append(a["id"])
        if tag in EXTERNAL and not (tag == "use" and a.get("xlink:href", a.get("href", "#")).startswith("#")):
            self.page.external.append(tag)
        for k in ("src", "href", "xlink:href", "action", "data"):
            if k in a and not a[k].startswith("#"):
                self.page.external.append(f"{tag} {k}={a[k]}")
        if "style" in a and "url(" in a["style"] and "url(#" not in a["style"]:
            self.page.external.append(f"{tag} style url")
        return a

    def handle_starttag(self, tag, attrs):
        a = self._check(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "section":
            self.section = a.get("id")
        elif tag == "figure":
            self.figure = a.get("id")
            self.page.figures[self.figure] = 0
        elif tag == "svg" and self.figure is not None:
            self.page.figures[self.figure] += 1
        elif tag == "table":
            self.page.tables += 1
        elif tag in ("title", "h2") or (tag == "span" and "verdict" in a.get("class", "")):
            self.capture, self.buf = ("verdict" if tag == "span" else tag), []

    def handle_startendtag(self, tag, attrs):
        self._check(tag, attrs)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if self.capture == tag or (self.capture == "verdict" and tag == "span"):
            text = "".join(self.buf).strip()
            if self.capture == "title":
                self.page.title = text
            elif self.capture == "h2" and self.section is not None:
                self.page.sections[self.section] = text
            elif self.capture == "verdict":
                self.page.verdicts.append(text)
            self.capture = None
        if tag == "figure":
            self.figure = None

    def handle_data(self, data):
        self.chunks.append(data)
        if self.capture:
            self.buf.append(data)


def read_page(path: Path) -> Page:
    """Parse a report, checking that every element is closed where it was opened."""
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    r = _Reader()
    r.feed(text)
    r.close()
    assert r.stack == [], f"unclosed: {r.stack}"
    r.page.text = " ".join(" ".join(r.chunks).split())
    return r.page


def assert_self_contained(page: Page) -> None:
    assert page.external == [], page.external
    dup = {i for i in page.ids if page.ids.count(i) > 1}
    assert not dup, f"duplicate ids: {sorted(dup)[:5]}"


def assert_figures(page: Page, names: list[str]) -> None:
    for name in names:
        assert page.figures.get(name) == 1, (name, page.figures)
