"""The lab panel in a real browser: Debian's chromium, driven by playwright, against a
JupyterLab server started here, with the quickstart notebook in a sub-folder (the binder
layout: notebooks/ under the server root; no WORKBENCH_RUNS_DIR, so the kernel writes
notebooks/workbench-runs/). The panel opens from the command palette, shows the fleet
with charts (axes, legends) and each rank's log, saves and restores a checkpoint, scales
2 -> 3 with its phases shown live, survives a reload, interrupts a running cell, sees an
engine die and recovers it, stops the fleet, and finds the run on disk. Screenshots go to
tests/artifacts/."""

from __future__ import annotations

import os
import pathlib
import re
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

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: apt-get install -y chromium (.ci/run does)")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on localhost with the installed workbench panel; a copy of the quickstart."""
    root = tmp_path_factory.mktemp("lab-root")
    (root / "notebooks").mkdir()
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", root / "notebooks")
    settings = root / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    env.pop("WORKBENCH_RUNS_DIR", None)  # runs go next to the notebook, where the panel must find them
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         f"--LabApp.workspaces_dir={root / 'workspaces'}", f"--LabApp.user_settings_dir={root / 'settings'}",
         "--LabApp.expose_app_in_browser=True"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    ARTIFACTS.mkdir(exist_ok=True)  # screenshots and the server's log, kept for a failure (not in a clone)
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
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"{url}/lab/tree/notebooks/01_quickstart.ipynb?token={token}")
        yield page
        browser.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"lab-panel-{name}.png"))


_PANEL_STATE_CODE = """import json, workbench.kernel.panel as wp, workbench.kernel.magics as wm
fleet = wm.current_fleet()
print('fresh ranks', fleet and fleet.session.fresh_ranks, [(c.last_error, c.thread.is_alive(), json.loads(c.sent_state or '{}').get('needs_recover')) for c in wp._comms.values()])"""


def _kernel_output(page, code: str) -> str:
    """What ``code`` prints in the notebook's kernel (run beside the panel, as a diagnosis)."""
    return page.evaluate("""async code => {
        const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
        const out = [];
        const future = kernel.requestExecute({code, store_history: false});
        future.onIOPub = msg => { if (msg.content.text || msg.content.evalue) out.push(msg.content.text || msg.content.evalue); };
        await future.done;
        return out.join('');
    }""", code)


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


def _open_command_palette(page):
    """View > Activate Command Palette, as a user opens it. The modal palette closes when focus
    moves (the notebook still settling after load does that): try again until it stays open."""
    palette = page.locator(".lm-CommandPalette-input:visible")
    for _ in range(10):
        page.keyboard.press("Escape")
        page.locator(".lm-MenuBar-itemLabel", has_text="View").click()
        page.locator(".lm-Menu-itemLabel", has_text="Activate Command Palette").click()
        try:
            palette.wait_for(timeout=3_000)
            time.sleep(0.5)
            if palette.is_visible():
                return palette
        except playwright_api.TimeoutError:
            pass
    raise AssertionError("the command palette did not open")


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
    # the panel's command is in the command palette
    palette = _open_command_palette(page)
    _shot(page, "0-palette")
    palette.press_sequentially("workbench fleet")
    item = page.locator(".lm-CommandPalette-item", has_text="Show the workbench fleet panel")
    item.wait_for(state="visible", timeout=10_000)
    item.click()
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
    assert page.text_content(".wb-engines thead th:nth-child(4)") == "MiB"
    assert all(int(row[3]) > 50 for row in engines), engines  # memory, MiB
    page.wait_for_function("document.body.innerText.includes('FSDP  loss')", timeout=240_000)
    page.wait_for_function(
        "Number(document.querySelector('.wb-chart-loss svg')?.dataset.points || 0) >= 160", timeout=30_000)
    # a line per rank in both curves, with axes and a legend outside the data
    assert panel.locator(".wb-chart-loss polyline").count() == 2
    assert panel.locator(".wb-chart-throughput polyline").count() == 2
    assert panel.locator(".wb-chart-loss text.wb-chart-tick").count() >= 5  # 3 y ticks, first and last step
    assert panel.locator(".wb-chart-loss .wb-legend-item").all_text_contents()[0].startswith("rank 0: ")
    assert panel.locator(".wb-chart-throughput .wb-legend-item").count() == 2
    # the ranks measured samples/s (the prepared model's batches): the figure the summary shows
    assert panel.locator(".wb-chart-throughput .wb-chart-title").text_content().startswith("throughput (samples/s)")
    assert "2 ranks (gloo)" in panel.locator(".wb-status").text_content()
    # the engines table fits the sidebar as JupyterLab opens it: no column cut, no scrolling
    fit = page.evaluate("""() => {
        const table = document.querySelector('.wb-engines');
        const cut = Array.from(table.querySelectorAll('td, th')).filter(c => c.scrollWidth > c.clientWidth + 1);
        return {panel: document.querySelector('#workbench-panel').clientWidth, table: table.scrollWidth,
                box: table.parentElement.clientWidth, cut: cut.map(c => c.textContent)};
    }""")
    print(f"engines table at the default sidebar width: {fit}")
    assert fit["table"] <= fit["box"] and not fit["cut"], fit
    # disabled buttons look disabled (nothing to recover, nothing to interrupt)
    recover = panel.locator("button[data-action=recover]")
    assert recover.is_disabled()
    assert float(recover.evaluate("b => getComputedStyle(b).opacity")) < 0.6
    # each rank's output of the run, read from the run folder next to the notebook
    page.wait_for_function("Number(document.querySelector('.wb-log-choice')?.dataset.count || 0) >= 2",
                           timeout=30_000)
    assert panel.locator(".wb-log-choice option").all_text_contents()[:2] == ["rank-0", "rank-1"]
    page.wait_for_function("document.querySelector('.wb-log').textContent.includes('epoch 4: loss')",
                           timeout=15_000)
    assert "rank 0 of 2 on cpu" in panel.locator(".wb-log").text_content()
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

    # scale to 3 from the panel: its phases show in the message line while they run
    page.evaluate("""() => {
        const message = document.querySelector('.wb-message');
        window.wbMessages = [];
        new MutationObserver(() => window.wbMessages.push(message.textContent))
            .observe(message, {childList: true, characterData: true, subtree: true});
    }""")
    panel.locator(".wb-ranks").fill("3")
    panel.locator("button[data-action=scale]").click()
    engines = _wait_engines(page, 3, timeout_s=180)
    assert [row[0] for row in engines] == ["0", "1", "2"]
    assert "3 ranks (gloo)" in panel.locator(".wb-status").text_content()
    page.wait_for_function("document.querySelector('.wb-message').textContent.includes('done in')", timeout=30_000)
    seen = page.evaluate("window.wbMessages")
    assert any("…" in text and "done in" not in text for text in seen), seen  # a phase while it ran
    _shot(page, "2-scaled-to-3")

    # a reload: the panel comes back with the same fleet and the run's curves
    page.reload()
    page.wait_for_selector("#workbench-panel .wb-engines", timeout=60_000)
    engines = _wait_engines(page, 3, timeout_s=60)
    page.wait_for_function(
        "Number(document.querySelector('.wb-chart-loss svg')?.dataset.points || 0) >= 160", timeout=30_000)
    _shot(page, "3-after-reload")

    # Interrupt stops a running cell on every rank; the fleet stays
    page.evaluate("""() => {
        const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
        window.wbLong = kernel.requestExecute({code: '%%distributed\\nimport time\\ntime.sleep(120)'});
        window.wbLongReply = null;
        window.wbLong.done.then(reply => { window.wbLongReply = reply.content; });
    }""")
    interrupt = panel.locator("button[data-action=interrupt]")
    page.wait_for_function("!document.querySelector('button[data-action=interrupt]').disabled", timeout=10_000)
    time.sleep(1.0)  # the ranks are in the cell
    started = time.monotonic()
    interrupt.click()
    page.wait_for_function("window.wbLongReply !== null", timeout=30_000)
    assert page.evaluate("window.wbLongReply.ename") == "KeyboardInterrupt"
    assert time.monotonic() - started < 15
    engines = _wait_engines(page, 3, timeout_s=30)

    # a long cell that ends says so (and notifies, where allowed); a NaN loss is marked on its curve
    page.evaluate("""() => {
        window.wbNotes = [];
        window.Notification = class { constructor(title, options) { window.wbNotes.push(options.body); } };
        window.Notification.permission = 'granted';
        const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
        kernel.requestExecute({code: 'import workbench.kernel.panel\\nworkbench.kernel.panel.LONG_CELL_S = 1.0'});
        kernel.requestExecute({code: '%%distributed --stop-on-nan\\nimport time\\ntime.sleep(1.5)\\n'
                                     + 'workbench.log(loss=float("nan"))'});
    }""")
    page.wait_for_function("window.wbNotes.length > 0", timeout=30_000)
    note = page.evaluate("window.wbNotes[0]")
    assert re.fullmatch(r"distributed-cell-\d+ failed after \ds", note), note
    page.wait_for_function("(document.querySelector('.wb-chart-loss .wb-chart-nonfinite-note')?.textContent || '')"
                           ".includes('loss is NaN or infinite at step')", timeout=15_000)
    assert panel.locator(".wb-chart-loss line.wb-chart-nonfinite").count() >= 1
    _shot(page, "3b-nan-marked")

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

    # Recover replaces the dead engine (enabled only now)
    page.wait_for_function("!document.querySelector('button[data-action=recover]').disabled", timeout=10_000)
    panel.locator("button[data-action=recover]").click()
    engines = _wait_engines(page, 3, timeout_s=120)
    # the new engine shows once it registered; Recover disables when the recovery has finished
    # (setup replay and restore come after)
    try:
        page.wait_for_function("document.querySelector('button[data-action=recover]').disabled", timeout=60_000)
    except playwright_api.TimeoutError:
        print("the kernel's panel state after recover:", _kernel_output(page, _PANEL_STATE_CODE))
        raise
    engines = _engines(page)
    assert int(engines[2][4]) != pids[2] and recover.is_disabled()
    page.wait_for_function("document.querySelector('.wb-message').textContent.includes('recover')", timeout=30_000)
    pids = [int(row[4]) for row in engines]
    _shot(page, "4b-recovered")

    # stop from the panel: no engine is left
    panel.locator("button[data-action=stop]").click()
    page.wait_for_function("document.querySelector('.wb-status').dataset.running === 'false'", timeout=60_000)
    assert _engines(page) == []
    assert "no fleet running" in panel.locator(".wb-status").text_content()
    assert not wait_until_gone(pids), "engine processes outlived the fleet"
    # the run is listed from disk by the server routes, and its curves come back from there
    runs = panel.locator(".wb-runs .wb-run")
    runs.first.wait_for(timeout=15_000)
    run_id = next((root / "notebooks" / "workbench-runs").iterdir()).name
    assert not (root / "workbench-runs").exists()
    assert runs.first.get_attribute("data-run") == run_id
    # from the run's run.json: named after the notebook, stopped, how long, its final loss (nan: the
    # --stop-on-nan cell above logged the last one)
    page.wait_for_function("document.querySelector('.wb-runs .wb-run').textContent.includes('stopped')",
                           timeout=15_000)
    assert re.match(r"01_quickstart · stopped · \d+(m\d\ds|s) · loss ([0-9.e+-]+|nan) · \d+ checkpoints$",
                    runs.first.text_content()), runs.first.text_content()
    runs.first.click()
    page.wait_for_function("document.querySelector('.wb-message').textContent.includes('from disk')",
                           timeout=30_000)
    assert int(panel.locator(".wb-chart-loss svg").get_attribute("data-points")) >= 160
    # later cells logged without training (no samples): the chart stays in samples/s, one unit
    assert panel.locator(".wb-chart-throughput .wb-chart-title").text_content().startswith("throughput (samples/s)")
    _shot(page, "5-stopped")
    _hover_and_zoom(page, panel)
    _compare_two_runs(page, panel, root)


def _chart_range(panel) -> tuple[float, float]:
    svg = panel.locator(".wb-chart-loss svg")
    return float(svg.get_attribute("data-xmin")), float(svg.get_attribute("data-xmax"))


def _visible_box(locator, timeout: float = 10.0) -> dict:
    """``locator``'s box once it is on screen: the panel redraws its charts as data comes (a
    chart replaced right then has no box yet), and one below the fold is scrolled to first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            locator.scroll_into_view_if_needed(timeout=timeout * 1000)
            box = locator.bounding_box()
        except playwright_api.Error:  # replaced while it was looked at ("not attached to the DOM")
            box = None
        if box is not None or time.monotonic() > deadline:
            assert box is not None, "the chart never came on screen"
            return box
        time.sleep(0.2)


def _hover_and_zoom(page, panel):
    """Hovering names each rank's value at the step under the pointer; a drag zooms into
    those steps; a double click zooms out."""
    box = _visible_box(panel.locator(".wb-chart-loss svg"))
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.4)
    tip = panel.locator(".wb-chart-loss .wb-chart-tip")
    tip.wait_for(timeout=5_000)
    lines = tip.text_content().split("\n")
    assert re.fullmatch(r"step \d+", lines[0]) and lines[1].startswith("rank 0: ") and lines[2].startswith("rank 1: "), lines
    assert panel.locator(".wb-chart-loss line.wb-chart-cursor").count() == 1
    _shot(page, "6-hover")
    full = _chart_range(panel)
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.5)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.5, steps=5)
    page.mouse.up()
    zoomed = _chart_range(panel)
    assert full[0] < zoomed[0] < zoomed[1] < full[1], (full, zoomed)
    assert panel.locator(".wb-chart-loss .wb-chart-reset").is_visible()
    _shot(page, "7-zoomed")
    panel.locator(".wb-chart-loss svg").dblclick()
    assert _chart_range(panel) == full
    page.mouse.move(0, 0)


def _compare_two_runs(page, panel, root):
    """A second run of the notebook's kernel; the newest run shown, the first drawn dashed beside it."""
    page.evaluate("""() => {
        const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
        kernel.requestExecute({code: '%fleet start -n 2'});
        kernel.requestExecute({code: '%%distributed\\nfor i in range(40):\\n    workbench.log(loss=30.0 - i * 0.5)'});
        kernel.requestExecute({code: '%fleet stop'});
    }""")
    page.wait_for_function("""() => {
        const runs = document.querySelectorAll('.wb-runs .wb-run');
        return runs.length === 2 && runs[0].textContent.includes('stopped');
    }""", timeout=120_000)
    runs = panel.locator(".wb-runs .wb-run")
    first_run, second_run = runs.nth(1).get_attribute("data-run"), runs.nth(0).get_attribute("data-run")
    assert sorted(p.name for p in (root / "notebooks" / "workbench-runs").iterdir()) == [first_run, second_run]
    # the run's record says stopped a moment before the kernel's state reaches the panel; a past run is
    # shown only once the panel knows no fleet runs (before, it says so and shows the live one)
    page.wait_for_function(f"document.querySelector('.wb-status').textContent.includes('no fleet running (last run "
                           f"{second_run})')", timeout=30_000)
    runs.nth(0).click()
    page.wait_for_function(f"document.querySelector('.wb-message').textContent.includes('run {second_run} (from disk)')",
                           timeout=30_000)
    panel.locator(f".wb-compare[data-run='{first_run}']").click()
    page.wait_for_function("document.querySelectorAll('.wb-chart-loss polyline.wb-chart-overlay').length === 2",
                           timeout=30_000)
    assert panel.locator(".wb-chart-loss polyline:not(.wb-chart-overlay)").count() == 2
    assert panel.locator(".wb-chart-throughput polyline.wb-chart-overlay").count() == 2
    legend = panel.locator(".wb-chart-loss .wb-legend-overlay").text_content()
    assert legend.startswith("dashed: 01_quickstart") and first_run in legend, legend
    assert _chart_range(panel)[1] > 39  # the x axis spans both runs (the second has steps 0-39)
    _shot(page, "8-compared")
    panel.locator(f".wb-compare[data-run='{first_run}']").click()
    page.wait_for_function("document.querySelectorAll('.wb-chart-loss polyline.wb-chart-overlay').length === 0",
                           timeout=10_000)
