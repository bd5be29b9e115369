"""The playground's files work under a strict Content-Security-Policy (same-origin scripts and
styles only): no inline script bodies, no ``on*=`` handler attributes, no ``style=`` attributes,
nothing loaded from another origin; every referenced asset is shipped."""

from __future__ import annotations

import re

from qserve.server.playground import UI_DIR


def test_page_has_no_inline_code_and_loads_only_shipped_assets():
    html = (UI_DIR / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "inline <script> body"
    assert not re.search(r"\son[a-z]+\s*=", html, re.I), "on*= handler attribute"
    assert not re.search(r"\sstyle\s*=", html, re.I), "style attribute"
    assets = re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', html)
    assert "/ui/static/markdown.js" in assets and "/ui/static/app.js" in assets
    for asset in assets:
        assert (UI_DIR / asset.removeprefix("/ui/static/")).is_file(), asset
    for name in ("app.js", "markdown.js", "style.css"):
        text = (UI_DIR / name).read_text()
        assert "http://" not in text and "https://" not in text.replace("https?:", ""), name
    assert "style=" not in (UI_DIR / "app.js").read_text()  # widths are set through the CSSOM
