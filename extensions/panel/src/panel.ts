/**
 * The side panel: the active notebook's fleet (engines, spares), live loss and
 * throughput curves, checkpoints, and buttons that run %fleet / %checkpoint in
 * that notebook's kernel. Without a live fleet it lists the runs on disk
 * (served by the workbench server routes) and shows a chosen run's curves and
 * checkpoints, and each rank's log of that run.
 */

import { PathExt } from '@jupyterlab/coreutils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { Chart } from './chart';
import { ConnectionStatus, FleetConnection } from './connection';
import { Curves } from './curves';
import { ICheckpoint, IFleetState, ILastCell, KernelMessage } from './protocol';
import { fetchCheckpoints, fetchLog, fetchLogs, fetchMetrics, fetchRuns } from './server';

const STATUS_TEXT: Record<ConnectionStatus, string> = {
  'no-notebook': 'Open a notebook to see its fleet.',
  'no-kernel': 'This notebook has no running kernel.',
  connecting: 'Connecting to the notebook kernel…',
  'not-loaded': 'workbench is not loaded in this kernel (Start loads it).',
  connected: ''
};

function element<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className = '',
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  node.textContent = text;
  return node;
}

/** 95 s -> "1m35s", 4000 s -> "1h06m" */
function duration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s`;
  }
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}

function formatNumber(value: number): string {
  return Math.abs(value) >= 1e4 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(3) : value.toPrecision(4);
}

function fillTable(table: HTMLTableElement, header: string[], rows: (string | Node)[][]): void {
  table.textContent = '';
  const head = table.createTHead().insertRow();
  header.forEach(h => head.appendChild(element('th', '', h)));
  const body = table.createTBody();
  rows.forEach(cells => {
    const row = body.insertRow();
    cells.forEach(cell => {
      const td = row.insertCell();
      if (typeof cell === 'string') {
        td.textContent = cell;
        td.title = cell; // the whole text where the column cuts it
      } else {
        td.appendChild(cell);
      }
    });
  });
}

export class WorkbenchPanel extends Widget {
  private _connection: FleetConnection;
  private _state: IFleetState | null = null;
  private _shownRun: string | null = null; // whose curves are shown
  private _curves = new Curves();
  private _compared: { run: string; label: string; curves: Curves } | null = null; // a run drawn dashed beside
  private _pending = new Set<string>(); // commands sent to the kernel, until they finish
  private _redraw = 0;
  private _lastCellEnded: number | undefined = undefined; // the newest cell end the panel has seen
  private _runsTimer = 0;
  private _buttonsTimer = 0;
  private _runsFolder: string | null = null; // the notebook folder whose runs are listed

  private _status = element('div', 'wb-status');
  private _ranks = element('input', 'wb-ranks');
  private _buttons = new Map<string, HTMLButtonElement>();
  private _message = element('pre', 'wb-message');
  private _engines = element('table', 'wb-table wb-engines');
  private _spares = element('div', 'wb-spares');
  private _lossChart = new Chart(element('div', 'wb-chart-box wb-chart-loss'));
  private _throughputChart = new Chart(element('div', 'wb-chart-box wb-chart-throughput'));
  private _checkpoints = element('table', 'wb-table wb-checkpoints');
  private _runsBox = element('div', 'wb-runs');
  private _logChoice = element('select', 'wb-log-choice');
  private _log = element('pre', 'wb-log');

  constructor(tracker: INotebookTracker) {
    super();
    this.addClass('wb-panel');
    this.id = 'workbench-panel';
    this.title.caption = 'workbench: fleet, metrics, checkpoints';
    this._build();
    this.node.addEventListener(
      'click',
      () => {
        if ('Notification' in window && Notification.permission === 'default') {
          void Notification.requestPermission(); // asked at a click: browsers allow it only then
        }
      },
      { once: true }
    );
    this._connection = new FleetConnection(tracker);
    this._connection.messages.connect((_, msg) => this._onMessage(msg));
    this._connection.statusChanged.connect(() => {
      this._render();
      if (this._folder() !== this._runsFolder) {
        void this._refreshRuns();
      }
    });
    this._render();
  }

  dispose(): void {
    window.clearInterval(this._runsTimer);
    window.clearInterval(this._buttonsTimer);
    super.dispose();
  }

  /** The active notebook's folder (relative to the server root): its kernel writes workbench-runs/ there. */
  private _folder(): string {
    const path = this._connection.notebook?.context.path;
    return path ? PathExt.dirname(path) : '';
  }

  private _build(): void {
    const root = this.node;
    root.appendChild(element('h2', 'wb-title', 'workbench fleet'));
    root.appendChild(this._status);
    const controls = element('div', 'wb-controls');
    const label = element('label', '', 'ranks ');
    this._ranks.type = 'number';
    this._ranks.min = '1';
    this._ranks.value = '2';
    label.appendChild(this._ranks);
    controls.appendChild(label);
    for (const [action, text, tip] of [
      ['start', 'Start', '%fleet start -n RANKS'],
      ['scale', 'Scale', '%fleet scale RANKS (keeps the training state)'],
      ['interrupt', 'Interrupt', 'interrupt the kernel: the running cell stops on every rank'],
      ['recover', 'Recover', '%fleet recover: replace dead engines, replay the setup cells, restore the state'],
      ['unpark', 'Unpark', '%fleet unpark: start the parked fleet\'s engines again and restore its state'],
      ['stop', 'Stop', '%fleet stop']
    ]) {
      const button = element('button', 'jp-mod-styled wb-button', text);
      button.dataset.action = action;
      button.title = tip;
      button.onclick = () => this._press(action);
      this._buttons.set(action, button);
      controls.appendChild(button);
    }
    root.appendChild(controls);
    root.appendChild(this._message);
    root.appendChild(element('h3', '', 'Engines'));
    root.appendChild(this._engines);
    root.appendChild(this._spares);
    root.appendChild(element('h3', '', 'Metrics'));
    root.appendChild(this._lossChart.host);
    root.appendChild(this._throughputChart.host);
    const heading = element('h3', '', 'Checkpoints ');
    const save = element('button', 'jp-mod-styled wb-button', 'Save checkpoint');
    save.dataset.action = 'save';
    save.onclick = () => this._press('save');
    this._buttons.set('save', save);
    heading.appendChild(save);
    root.appendChild(heading);
    root.appendChild(this._checkpoints);
    root.appendChild(element('h3', '', 'Logs'));
    const logsBar = element('div', 'wb-logs-bar');
    logsBar.appendChild(this._logChoice);
    this._logChoice.onchange = () => void this._refreshLog();
    root.appendChild(logsBar);
    root.appendChild(this._log);
    root.appendChild(element('h3', '', 'Runs on disk'));
    root.appendChild(this._runsBox);
    this._runsTimer = window.setInterval(() => {
      void this._refreshRuns();
      void this._refreshLogs();
    }, 5000);
    this._buttonsTimer = window.setInterval(() => this._updateButtons(), 500);
    void this._refreshRuns();
  }

  private _press(action: string): void {
    const n = Number(this._ranks.value);
    if ((action === 'start' || action === 'scale') && !(Number.isInteger(n) && n >= 1)) {
      this._say(`ranks must be a whole number of at least 1 (got ${this._ranks.value || 'nothing'})`, true);
      return;
    }
    if (action === 'interrupt') {
      this._connection.interrupt().then(
        () => this._say('interrupt sent: the running cell stops on every rank'),
        error => this._say(String(error), true)
      );
      return;
    }
    const loaded = this._connection.status === 'connected';
    const commands: Record<string, string> = {
      start: (loaded ? '' : '%load_ext workbench\n') + `%fleet start -n ${n}`,
      scale: `%fleet scale ${n}`,
      recover: '%fleet recover',
      unpark: '%fleet unpark',
      stop: '%fleet stop',
      save: '%checkpoint save'
    };
    this._run(commands[action]);
  }

  /** Run a command in the kernel; its output (phases, errors) shows in the message line as it comes. */
  private _run(command: string): void {
    this._pending.add(command);
    this._say('');
    this._render();
    this._connection.execute(command, text => this._say(text)).then(
      ({ ok, output }) => {
        this._pending.delete(command);
        this._say(output || `${command}: ${ok ? 'done' : 'failed'}`, !ok);
        this._render();
        void this._connection.reconnect();
      },
      error => {
        this._pending.delete(command);
        this._say(String(error), true);
        this._render();
      }
    );
  }

  private _say(text: string, error = false): void {
    this._message.textContent = text;
    this._message.classList.toggle('wb-error', error);
  }

  private _onMessage(msg: KernelMessage): void {
    if (msg.run !== this._shownRun) {
      this._showRun(msg.run);
    }
    if (msg.type === 'metrics') {
      this._curves.add(msg.points);
      this._scheduleCharts();
    } else {
      const stopped = !!this._state?.running && !msg.running;
      this._cellEnded(msg.last_cell ?? null);
      this._state = msg;
      this._render();
      if (stopped) {
        void this._refreshRuns(); // its record now says stopped, with a duration
      }
    }
  }

  /**
   * A cell that ran long ended: say so in the message line and, where the browser allows it,
   * as a notification (asked for at the first click in the panel). A cell that ended before
   * the panel opened is not news.
   */
  private _cellEnded(cell: ILastCell | null): void {
    if (cell === null || cell.ended === this._lastCellEnded) {
      return;
    }
    const first = this._lastCellEnded === undefined;
    this._lastCellEnded = cell.ended;
    if (first || !cell.long) {
      return;
    }
    const how = cell.status === 'ok' ? 'finished' : cell.status;
    const text = `${cell.cell} ${how} after ${duration(cell.seconds)}`;
    this._say(text, cell.status !== 'ok');
    if ('Notification' in window && Notification.permission === 'granted') {
      new Notification('workbench', { body: text });
    }
  }

  private _showRun(run: string | null): void {
    this._shownRun = run;
    this._curves = new Curves();
    if (this._compared?.run === run) {
      this._compared = null;
    }
    this._lossChart.reset();
    this._throughputChart.reset();
    this._scheduleCharts();
    this._logChoice.textContent = '';
    this._log.textContent = '';
    void this._refreshLogs();
  }

  private _scheduleCharts(): void {
    if (this._redraw) {
      return;
    }
    this._redraw = window.setTimeout(() => {
      this._redraw = 0;
      const curves = this._curves,
        compared = this._compared;
      this._lossChart.draw(
        curves.scalarName ?? 'loss',
        curves.loss,
        compared && { label: compared.label, series: compared.curves.loss }
      );
      this._throughputChart.draw(
        `throughput (${curves.throughputName})`,
        curves.throughput,
        compared && { label: compared.label, series: compared.curves.throughput }
      );
    }, 200);
  }

  private _render(): void {
    const status = this._connection.status;
    const state = status === 'connected' ? this._state : null;
    const running = !!state?.running;
    const notebook = this._connection.notebook?.context.path ?? '';
    let text = STATUS_TEXT[status];
    if (state) {
      text = state.parked
        ? `${notebook}: parked (${state.parked.world} ranks, state in ${state.parked.tag}; the next cell brings it back), run ${state.run}`
        : running
          ? `${notebook}: ${state.world_size} ranks (${state.backend}), run ${state.run}`
          : `${notebook}: no fleet running` + (state.run ? ` (last run ${state.run})` : '');
    }
    const waiting = [...this._pending].map(c => c.split('\n').pop());
    if (waiting.length) {
      text +=
        ` · running ${waiting.join(', ')}…` +
        (this._connection.cellRunning ? ' (after the cell that is running)' : '');
    }
    this._status.textContent = text;
    this._status.dataset.running = String(running);
    this._status.dataset.parked = String(!!state?.parked);
    this._status.dataset.connection = status;
    this._updateButtons();
    const busy = waiting.length > 0;
    const engines = state?.engines ?? [];
    fillTable(
      this._engines,
      ['rank', 'device', 'state', 'MiB', 'pid'],
      engines.map(e => [
        String(e.rank),
        e.device,
        element('span', `wb-state wb-state-${e.state.split(' ')[0]}`, e.state), // dead, slow 1.6×, silent: coloured
        // a dead engine's last memory figure is not its memory now
        e.memory_mb === null || e.memory_mb === undefined || e.state === 'dead' ? '-' : String(Math.round(e.memory_mb)),
        String(e.pid)
      ])
    );
    const memoryHeader = this._engines.tHead?.rows[0]?.cells[3];
    if (memoryHeader) {
      memoryHeader.title = 'memory in MiB: the process RSS, or CUDA max allocated on a GPU';
    }
    const hosts = [...new Set(engines.map(e => e.host))];
    this._engines.title = hosts.length ? `on ${hosts.join(', ')}` : '';
    this._engines.dataset.count = String(engines.length);
    const spares = state?.spares;
    this._spares.textContent =
      spares && (spares.ready || spares.starting)
        ? `spares: ${spares.ready} warm` + (spares.starting ? `, ${spares.starting} starting` : '')
        : '';
    if (state) {
      this._fillCheckpoints(state.checkpoints, running && !busy);
    }
  }

  /** Each button is enabled only when it can do something now. */
  private _updateButtons(): void {
    const status = this._connection.status;
    const state = status === 'connected' ? this._state : null;
    const running = !!state?.running;
    const busy = this._pending.size > 0;
    const broken = !!state?.needs_recover || (state?.engines ?? []).some(e => e.state === 'dead');
    const parked = !!state?.parked;
    const can: Record<string, boolean> = {
      start: (status === 'not-loaded' || (status === 'connected' && !running)) && !busy,
      scale: running && !busy,
      unpark: parked && !busy,
      interrupt: status !== 'no-notebook' && status !== 'no-kernel' && (busy || this._connection.kernelBusy),
      recover: running && !busy && broken,
      stop: running && !busy,
      save: running && !busy
    };
    this._buttons.forEach((button, action) => {
      button.disabled = !can[action];
    });
  }

  /** The shown run's log files (rank-N.log, engine-*.log), read through the server routes. */
  private async _refreshLogs(): Promise<void> {
    const run = this._shownRun;
    if (!run || (!this.isVisible && this._logChoice.childElementCount)) {
      return;
    }
    try {
      const { logs } = await fetchLogs(this._folder(), run);
      const names = logs.map(l => l.name);
      const current = [...this._logChoice.options].map(o => o.value);
      if (names.join() !== current.join()) {
        const keep = this._logChoice.value;
        this._logChoice.textContent = '';
        for (const name of names) {
          const option = element('option', '', name.replace(/\.log$/, ''));
          option.value = name;
          this._logChoice.appendChild(option);
        }
        this._logChoice.value = names.includes(keep) ? keep : names[0] ?? '';
      }
      this._logChoice.dataset.count = String(names.length);
      await this._refreshLog();
    } catch (error) {
      this._log.textContent = `logs are not available: ${error}`;
    }
  }

  private async _refreshLog(): Promise<void> {
    const run = this._shownRun;
    const name = this._logChoice.value;
    if (!run || !name) {
      this._log.textContent = run ? 'no logs yet: they are written as cells end' : '';
      return;
    }
    const log = await fetchLog(this._folder(), run, name);
    const atEnd = this._log.scrollTop + this._log.clientHeight >= this._log.scrollHeight - 4;
    this._log.textContent = (log.cut ? '… (the start is cut: the whole file is in the run folder)\n' : '') + log.text;
    this._log.dataset.name = name;
    if (atEnd) {
      this._log.scrollTop = this._log.scrollHeight;
    }
  }

  private _fillCheckpoints(checkpoints: ICheckpoint[], canRestore: boolean): void {
    fillTable(
      this._checkpoints,
      ['tag', 'step', 'ranks', ''],
      checkpoints.map(c => {
        const complete = c.state === 'complete';
        const restore = element('button', 'jp-mod-styled wb-button', complete ? 'restore' : 'writing…');
        restore.dataset.action = 'restore';
        restore.dataset.tag = c.tag;
        restore.title = complete ? `%checkpoint restore ${c.tag}` : 'being written';
        restore.disabled = !canRestore || !complete;
        restore.onclick = () => this._run(`%checkpoint restore ${c.tag}`);
        return [c.tag, String(c.step ?? '-'), String(c.world_size ?? '-'), restore];
      })
    );
    this._checkpoints.querySelectorAll('tbody tr').forEach((row, i) => {
      (row as HTMLElement).dataset.state = checkpoints[i].state;
    });
    this._checkpoints.dataset.count = String(checkpoints.length);
  }

  private async _refreshRuns(now = false): Promise<void> {
    const folder = this._folder();
    if (!now && !this.isVisible && this._runsBox.childElementCount && folder === this._runsFolder) {
      return;
    }
    try {
      const { runs } = await fetchRuns(folder);
      this._runsFolder = folder;
      this._runsBox.textContent = '';
      if (!runs.length) {
        this._runsBox.textContent = 'none yet';
      }
      for (const run of runs.slice(0, 10)) {
        const parts = [run.name ?? run.id];
        if (run.status) {
          parts.push(run.status);
        }
        if (typeof run.duration_s === 'number') {
          parts.push(duration(run.duration_s));
        }
        if (run.loss !== undefined && run.loss !== null) {
          parts.push(`loss ${typeof run.loss === 'number' ? formatNumber(run.loss) : run.loss}`);
        }
        parts.push(`${run.checkpoints} checkpoints`);
        const row = element('div', 'wb-run-row');
        const item = element('button', 'wb-run', parts.join(' · '));
        item.title = run.id;
        item.dataset.status = run.status ?? '';
        item.dataset.run = run.id;
        item.onclick = () => void this._showDiskRun(run.id);
        row.appendChild(item);
        const compared = this._compared?.run === run.id;
        const compare = element('button', 'jp-mod-styled wb-button wb-compare', compared ? 'hide' : 'compare');
        compare.dataset.run = run.id;
        compare.dataset.compared = String(compared);
        compare.title = compared
          ? 'stop drawing this run beside the shown one'
          : "draw this run's curves beside the shown run's (dashed)";
        compare.onclick = () => void this._compare(run.id, run.name ?? run.id);
        row.appendChild(compare);
        this._runsBox.appendChild(row);
      }
    } catch (error) {
      this._runsBox.textContent = `runs on disk are not available: ${error}`;
    }
  }

  /** A past run's curves and checkpoints, read through the server routes. */
  private async _showDiskRun(run: string): Promise<void> {
    if (this._state?.running) {
      this._say('a fleet is running: its run is shown (stop it to look at past runs)');
      return;
    }
    this._showRun(run);
    await this._load(run, this._curves);
    this._scheduleCharts();
    this._fillCheckpoints((await fetchCheckpoints(this._folder(), run)).checkpoints, false);
    this._say(`run ${run} (from disk)`);
  }

  /** Draw (or stop drawing) another run's curves beside the shown run's, dashed. */
  private async _compare(run: string, label: string): Promise<void> {
    if (this._compared?.run === run) {
      this._compared = null;
    } else {
      const curves = new Curves(this._curves.scalarName);
      await this._load(run, curves);
      this._compared = { run, label: `${label} (${run})`, curves };
      this._say(`comparing with run ${run}: its curves are dashed`);
    }
    this._scheduleCharts();
    void this._refreshRuns(true);
  }

  /** A run's records from its metrics.jsonl, page by page. */
  private async _load(run: string, curves: Curves): Promise<void> {
    let since = 0;
    for (;;) {
      const page = await fetchMetrics(this._folder(), run, since);
      curves.add(
        page.records.map(r => [
          r.rank,
          r.step,
          r.time,
          r.scalars,
          r.system.samples_per_s ?? null,
          r.system.step_time_s ?? null
        ])
      );
      if (page.next === since || !page.records.length) {
        break;
      }
      since = page.next;
    }
  }
}
