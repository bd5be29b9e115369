"""Browser security headers (issue 31): the playground and other HTML answers carry a
Content-Security-Policy, X-Frame-Options and nosniff; JSON answers nosniff; /docs works on a
keyed server, with the bearer key declared for Swagger UI's "Authorize" button."""

from __future__ import annotations

import re

import httpx

from qserve.server.playground import UI_DIR

AUTH = {"Authorization": "Bearer sekret"}


def test_the_playground_page_gets_a_strict_policy_it_can_live_with(guarded_server):
    page = httpx.get(f"{guarded_server.url}/")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "style-src 'self';" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    # Nothing inline that the policy would block: scripts by src, no style attributes or handlers.
    html = page.text
    assert all('src="/ui/static/' in tag for tag in re.findall(r"<script[^>]*>", html))
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", html)
    assert not re.search(r"style=|\son[a-z]+=", (UI_DIR / "app.js").read_text())


def test_json_answers_are_nosniff(guarded_server):
    for response in (
        httpx.get(f"{guarded_server.url}/v1/models", headers=AUTH),
        httpx.get(f"{guarded_server.url}/v1/models"),  # the 401 too
    ):
        assert response.headers["x-content-type-options"] == "nosniff"
        assert "content-security-policy" not in response.headers


def test_docs_open_on_a_keyed_server_and_declare_the_bearer_key(guarded_server):
    schema = httpx.get(f"{guarded_server.url}/openapi.json")
    assert schema.status_code == 200
    body = schema.json()
    assert body["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "--api-key or a tenant's key",
    }
    assert body["security"] == [{"bearerAuth": []}]
    docs = httpx.get(f"{guarded_server.url}/docs")
    if docs.status_code == 404:  # no local Swagger UI bundle (fastapi-offline) installed
        return
    assert docs.status_code == 200
    assert docs.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in docs.headers["content-security-policy"]
    for asset in re.findall(r'(?:src|href)="(/_docs_static/[^"]+)"', docs.text):
        assert httpx.get(f"{guarded_server.url}{asset}").status_code == 200, asset
    assert httpx.get(f"{guarded_server.url}/v1/models").status_code == 401  # the API itself still needs it
