"""The /experiments page in a real browser: headless Chromium (Debian's chromium and chromium-driver, driven by
selenium) loads it from a running picker, and the test reads what it rendered: the arms, the verdicts, and the
two charts drawn. ``INFERLB_SCREENSHOT=FILE`` also saves a screenshot there (the README's comes from this)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from pathlib import Path

import httpx
import pytest

from inferlb.picker import create_picker
from inferlb.procs import free_port
from inferlb.scorer.config import parse_config
from inferlb.scorer.features import RequestFeatures

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None, reason="needs Debian's chromium and chromium-driver (.ci/run installs them)"
)

TOKEN = "page-test-admin-token-0123456789"


@pytest.fixture
async def picker(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("INFERLB_PAGE_TEST_TOKEN", TOKEN)
    config = parse_config(
        {
            "listen": f"127.0.0.1:{free_port()}",
            "admin": f"127.0.0.1:{free_port()}",
            "admin_auth": {"token_env": "INFERLB_PAGE_TEST_TOKEN"},
            "policy": "default",
            "pool": {
                "endpoints": [
                    {"address": "127.0.0.1:1", "models": ["m"]},
                    {"address": "127.0.0.1:2", "models": ["m"]},
                    {"address": "127.0.0.1:3", "models": ["m"], "labels": {"version": "canary"}},
                ]
            },
            "experiments": [
                {
                    "name": "policy-test",
                    "scope": {"paths": ["/v1/completions"]},
                    "arms": [
                        {"name": "control", "profile": "round-robin", "weight": 0.5},
                        {"name": "treatment", "profile": "default", "weight": 0.5},
                    ],
                    "min_samples": 50,
                },
                {
                    "name": "release",
                    "arms": [
                        {"name": "stable", "profile": "default", "weight": 0.9},
                        {"name": "canary", "profile": "default", "weight": 0.1, "endpoints": {"version": "canary"}},
                    ],
                },
            ],
        }
    )
    picker = create_picker(config)
    await picker.start()
    router = picker.service.router
    experiments = router.experiments
    assert experiments is not None
    rng = random.Random(3)
    for i in range(600):
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        features = RequestFeatures(model="m", request_id=f"r{i}", path=path, prompt_tokens=100)
        routed = router.route(router.admit(features).request)
        routed.lease.release()
        # The treatment answers 30% sooner: the page must show it better.
        slower = routed.arm is not None and routed.arm.name == "control"
        experiments.first_token(f"r{i}", rng.lognormvariate(-1.5, 0.3) * (1.0 if slower else 0.7))
        experiments.outcome(f"r{i}", failed=False, e2e_s=1.0)
    experiments.running["release"].control("weights", {"stable": 0.95, "canary": 0.05})
    yield picker
    await picker.stop(0.2)


def _browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1400",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)


async def test_the_page_shows_arms_verdicts_and_draws_the_charts(picker, tmp_path: Path) -> None:
    url = f"http://{picker.config.admin}/experiments"
    # A client that does not ask for HTML gets the JSON the page draws from.
    async with httpx.AsyncClient(timeout=5) as client:
        assert [e["name"] for e in (await client.get(url)).json()["experiments"]] == ["policy-test", "release"]
    # The browser blocks: it runs on a thread while this loop serves the picker it reads.
    await asyncio.to_thread(_check_page, url, tmp_path)


def _check_page(url: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser()
    try:
        browser.get(url)
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, "section[data-experiment]"))
        sections = browser.find_elements(By.CSS_SELECTOR, "section[data-experiment]")
        assert [s.get_attribute("data-experiment") for s in sections] == ["policy-test", "release"]
        policy = sections[0]
        assert "control" in policy.text and "treatment" in policy.text and "round-robin" in policy.text
        verdict = policy.find_element(By.CSS_SELECTOR, "td[data-verdict='treatment/ttft']")
        assert verdict.text == "better" and verdict.get_attribute("class") == "better"
        assert "weights stable 95.0%, canary 5.0%" in sections[1].text
        assert "set by the operator" in sections[1].text  # the weight history's newest row
        # Both charts of each experiment are drawn: their canvases hold pixels that are not blank.
        for chart in ("ttft-cdf", "weights"):
            canvas = policy.find_element(By.CSS_SELECTOR, f"canvas[data-chart='{chart}']")
            painted = browser.execute_script(
                "const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;",
                canvas,
            )
            assert painted > 1000, chart
        shot = tmp_path / "experiments.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if os.environ.get("INFERLB_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["INFERLB_SCREENSHOT"])
    finally:
        browser.quit()
