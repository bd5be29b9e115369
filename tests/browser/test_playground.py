"""The playground in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by Selenium against the demo model. Sends a message, sees the
answer stream in, sees the live pool panel change and the stats line (tokens, tok/s, TTFT), finds
the conversation again after a reload (localStorage), sees Markdown render a code block with
HTML escaped, edits the last question, and writes screenshots
(``playground-running.png`` mid-answer, ``playground.png`` after) to ``$QSERVE_ARTIFACTS_DIR``,
else to pytest's temporary directory.

Skipped when the browser, its driver or selenium is missing, unless ``QSERVE_REQUIRE_BROWSER=1``
(CI sets it, so a missing browser fails there instead of passing silently).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from qserve.engine.async_engine import AsyncEngine, HostConfig, ModelSpec, build_engines
from qserve.quantize.demo import DEMO_MODEL
from qserve.server.app import create_app
from tests.server.conftest import serve

DEMO = DEMO_MODEL

pytestmark = pytest.mark.slow


def _browser_or_skip():
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        message = (
            f"browser test needs {', '.join(missing)}: apt-get install chromium chromium-driver; pip install selenium"
        )
        if os.environ.get("QSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)


@pytest.fixture(scope="module")
def demo_server():
    config = HostConfig(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_seqs=4)
    host = AsyncEngine(build_engines([ModelSpec("demo", str(DEMO))], config))
    with serve(create_app(host)) as url:
        yield url


def _wait(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def test_chat_streams_and_pool_panel_moves(demo_server, tmp_path):
    from selenium.webdriver.common.by import By

    driver = _browser_or_skip()
    out_dir = Path(os.environ.get("QSERVE_ARTIFACTS_DIR") or tmp_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        driver.get(demo_server + "/")
        assert driver.title == "qserve playground"
        _wait(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"), 20, "the model list")
        card = _wait(lambda: driver.find_elements(By.CSS_SELECTOR, '.model-card[data-model="demo"]'), 20, "pool panel")
        assert card

        def panel(cls: str) -> str:
            # Read in one script call: the panel is re-rendered every poll (elements go stale).
            selector = f'.model-card[data-model="demo"] .{cls}'
            return driver.execute_script(
                "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", selector
            )

        generated_before = int(panel("generated"))
        driver.find_element(By.ID, "temperature").clear()
        driver.find_element(By.ID, "temperature").send_keys("0")
        driver.find_element(By.ID, "max_tokens").clear()
        # 240 tokens keep the request running ~1.8 s after its first text: several of the panel's 500 ms
        # polls. With 60 (~0.4 s) a run could fall between two polls and never see it running (a full
        # suite run on 2026-12-05 did).
        driver.find_element(By.ID, "max_tokens").send_keys("240")
        driver.find_element(By.ID, "prompt").send_keys("def parse_args(")
        driver.find_element(By.ID, "send").click()

        reply = lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")  # noqa: E731
        busy = lambda: not driver.find_element(By.ID, "send").is_enabled()  # noqa: E731
        # Streaming: text shows up while the request is still running, and keeps growing.
        first = _wait(lambda: reply() and reply()[0].text and busy() and reply()[0].text, 60, "streamed text")
        seen_running = False
        lengths = [len(first)]
        while busy():
            if panel("running") == "1" and not panel("pages-used").startswith("0 "):
                if not seen_running:  # the request holds pages of the shared pool while it runs
                    driver.save_screenshot(str(out_dir / "playground-running.png"))
                seen_running = True
            lengths.append(len(reply()[0].text))
            time.sleep(0.05)
        assert max(lengths) > lengths[0], "the answer arrived in one piece, not streamed"
        assert seen_running, "the pool panel never showed the running request holding pages"
        _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"), 10, "the finished answer")
        assert "finish:" in driver.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text
        _wait(lambda: int(panel("generated")) > generated_before, 10, "the token counter to move")
        _wait(lambda: panel("running") == "0", 10, "the panel to show the request done")

        stats = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text
        assert "tok/s" in stats and "TTFT" in stats and "tokens" in stats, stats
        shot = out_dir / "playground.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")

        # The conversation is saved: a reload shows it again, stats line included.
        driver.refresh()
        _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.user .text"), 10, "the saved conversation")
        assert driver.find_element(By.CSS_SELECTOR, ".msg.user .text").text == "def parse_args("
        assert "tok/s" in driver.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text

        # Markdown: a fenced code block renders as code (with a copy button); HTML stays text.
        answer = 'Some **bold** text\n```python\nprint(1 < 2)\n```\n<img src=x onerror="window.pwned=1">'
        saved = [{"id": "md", "title": "md", "updated": 1, "messages": [
            {"role": "user", "content": "show code"}, {"role": "assistant", "content": answer}]}]  # fmt: skip
        driver.execute_script("localStorage.setItem('qserve.conversations', JSON.stringify(arguments[0]))", saved)
        driver.refresh()
        code = _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant pre code"), 10, "a code block")
        assert code[0].text == "print(1 < 2)"
        assert driver.find_elements(By.CSS_SELECTOR, ".msg.assistant pre button.copy")
        assert driver.find_element(By.CSS_SELECTOR, ".msg.assistant strong").text == "bold"
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg img")
        assert driver.execute_script("return window.pwned === undefined")
        assert '<img src=x onerror="window.pwned=1">' in driver.find_element(By.CSS_SELECTOR, ".msg.assistant").text
        # Edit: the last question goes back into the box, off the conversation.
        driver.find_element(By.ID, "edit").click()
        assert driver.find_element(By.ID, "prompt").get_attribute("value") == "show code"
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg")
    finally:
        driver.quit()
