"""The lab panel in a real browser: Debian's chromium, driven by playwright, against a
JupyterLab server started here. The quickstart notebook runs in the page; the panel
shows its fleet, saves and restores a checkpoint, scales 2 -> 3, survives a reload,
sees an engine die, and stops the fleet. Screenshots go to tests/artifacts/."""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import free_port, wait_for_jupyter, wait_until_gone
from playwright import sync_api as playwright_api

REPO = pathlib.Path(__file__).parent.parent
ARTIFACTS = pathlib.Path(__file__).parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on localhost with the installed workbench panel; a copy of the quickstart."""
    root = tmp_path_factory.mktemp("lab-root")
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", root)
    settings = root / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(root / "workbench-runs"), "WANDB_MODE": "disabled"}
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         f"--LabApp.workspaces_dir={root / 'workspaces'}", f"--LabApp.user_settings_dir={root / 'settings'}",
         "--LabApp.expose_app_in_browser=True"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    wait_for_jupyter(url, token, proc, (root / "lab.log").read_text)
    yield url, token, root
    proc.send_signal(signal.SIGINT)  # the server shuts its kernels down; their fleets go with them
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    shutil.copy(root / "lab.log", ARTIFACTS / "lab-browser-server.log")


@pytest.fixture(scope="module")
def page(lab):
    url, token, _root = lab
    assert CHROMIUM, "the browser test needs Debian's chromium: apt-get install -y chromium (.ci/run does)"
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"{url}/lab/tree/01_quickstart.ipynb?token={token}")
        yield page
        browser.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"lab-panel-{name}.png"))


def _engines(page) -> list[dict]:
    return page.eval_on_selector_all(
        ".wb-engines tbody tr",
        "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent))",
    )


def _wait_engines(page, count: int, state: str = "idle", timeout_s: float = 120) -> list:
    page.wait_for_function(
        """([count, state]) => {
            const rows = Array.from(document.querySelectorAll('.wb-engines tbody tr'));
            return rows.length === count && rows.every(r => r.cells[2].textContent === state);
        }""", arg=[count, state], timeout=timeout_s * 1000)
    return _engines(page)


def _message(page) -> str:
    return page.text_content(".wb-message") or ""


def test_panel_follows_the_quickstart_fleet(lab, page):
    try:
        _panel_walkthrough(lab, page)
    except Exception:
        _shot(page, "failure")  # what the page showed when it failed
        raise


def _panel_walkthrough(lab, page):
    _url, _token, root = lab
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_function("window.jupyterapp !== undefined", timeout=60_000)
    page.evaluate("window.jupyterapp.commands.execute('workbench:open-panel')")
    panel = page.locator("#workbench-panel")
    panel.wait_for(state="visible", timeout=30_000)
    # the kernel has not loaded workbench yet: the panel says so
    page.wait_for_function(
        "document.querySelector('.wb-status').dataset.connection === 'not-loaded'", timeout=60_000)

    # run every cell of the quickstart except the last (%fleet stop), as a user would
    page.locator(".jp-Notebook .jp-Cell").last.click()
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-above')")
    engines = _wait_engines(page, 2, timeout_s=120)
    assert [row[0] for row in engines] == ["0", "1"] and all(row[1] == "cpu" for row in engines)
    assert all(row[3].endswith("MiB") for row in engines), engines
    page.wait_for_function("document.body.innerText.includes('FSDP  loss')", timeout=240_000)
    page.wait_for_function(
        "Number(document.querySelector('.wb-chart-loss svg')?.dataset.points || 0) >= 160", timeout=30_000)
    # a line per rank in both curves
    assert panel.locator(".wb-chart-loss polyline").count() == 2
    assert panel.locator(".wb-chart-throughput polyline").count() == 2
    assert "2 ranks (gloo)" in panel.locator(".wb-status").text_content()
    _shot(page, "1-quickstart-2-ranks")

    # checkpoint save, then restore from its row
    panel.locator("button[data-action=save]").click()
    page.wait_for_function("document.querySelector('.wb-message').textContent.includes('saved')", timeout=60_000)
    page.wait_for_function("""() => {
        const rows = document.querySelectorAll('.wb-checkpoints tbody tr');
        return rows.length === 1 && rows[0].dataset.state === 'complete';
    }""", timeout=5_000)
    row = panel.locator(".wb-checkpoints tbody tr").first.locator("td")
    tag, step, world = row.nth(0).text_content(), row.nth(1).text_content(), row.nth(2).text_content()
    assert int(step) >= 80 and world == "2" and tag == f"step-{step}"
    panel.locator(f"button[data-action=restore][data-tag='{tag}']").click()
    page.wait_for_function("document.querySelector('.wb-message').textContent.includes('restored')",
                           timeout=60_000)
    assert f"restored checkpoint '{tag}' (step {step}) on 2 ranks" in _message(page)

    # scale to 3 from the panel
    panel.locator(".wb-ranks").fill("3")
    panel.locator("button[data-action=scale]").click()
    engines = _wait_engines(page, 3, timeout_s=180)
    assert [row[0] for row in engines] == ["0", "1", "2"]
    assert "3 ranks (gloo)" in panel.locator(".wb-status").text_content()
    _shot(page, "2-scaled-to-3")

    # a reload: the panel comes back with the same fleet and the run's curves
    page.reload()
    page.wait_for_selector("#workbench-panel .wb-engines", timeout=60_000)
    engines = _wait_engines(page, 3, timeout_s=60)
    page.wait_for_function(
        "Number(document.querySelector('.wb-chart-loss svg')?.dataset.points || 0) >= 160", timeout=30_000)
    _shot(page, "3-after-reload")

    # an engine killed from outside: the panel shows it dead within about a second
    pids = [int(row[4]) for row in engines]
    killed_at = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    page.wait_for_function("document.querySelectorAll('.wb-engines tbody tr')[2].cells[2].textContent === 'dead'",
                           timeout=10_000, polling=50)
    seen_after = time.monotonic() - killed_at
    print(f"panel showed the killed engine dead after {seen_after:.2f} s")
    assert seen_after < 2.0
    _shot(page, "4-engine-killed")

    # stop from the panel: no engine is left
    panel.locator("button[data-action=stop]").click()
    page.wait_for_function("document.querySelector('.wb-status').dataset.running === 'false'", timeout=60_000)
    assert _engines(page) == []
    assert "no fleet running" in panel.locator(".wb-status").text_content()
    assert not wait_until_gone(pids), "engine processes outlived the fleet"
    # the run is listed from disk by the server routes, and its curves come back from there
    runs = panel.locator(".wb-runs button")
    runs.first.wait_for(timeout=15_000)
    run_id = next((root / "workbench-runs").iterdir()).name
    assert runs.first.get_attribute("data-run") == run_id
    runs.first.click()
    page.wait_for_function("document.querySelector('.wb-message').textContent.includes('from disk')",
                           timeout=30_000)
    assert int(panel.locator(".wb-chart-loss svg").get_attribute("data-points")) >= 160
    _shot(page, "5-stopped")
