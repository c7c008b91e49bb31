"""Headless Debian Chromium through Playwright for the dashboard's browser tests: the `page`
fixture (a fresh profile each time) and the marks that skip without Chromium and bound a test."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 30_000

BROWSER_MARKS = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)",
    ),
    pytest.mark.timeout(180),
]


@pytest_asyncio.fixture
async def page() -> AsyncIterator[Any]:
    playwright_api = pytest.importorskip(
        "playwright.async_api", reason="playwright is not installed (pip install -e '.[dev]')"
    )
    profile = tempfile.mkdtemp(prefix="muster-chromium-")
    async with playwright_api.async_playwright() as pw:
        # A fresh profile directory each time (Playwright passes it as --user-data-dir).
        context = await pw.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            args=FLAGS,
            viewport={"width": 1280, "height": 800},
        )
        try:
            tab = context.pages[0] if context.pages else await context.new_page()
            tab.set_default_timeout(TIMEOUT_MS)
            yield tab
        finally:
            await context.close()
            shutil.rmtree(profile, ignore_errors=True)
