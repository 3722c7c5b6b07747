/**
 * The comm to the workbench in one notebook's kernel, following the notebook
 * that is active in JupyterLab. It reconnects when the kernel changes or
 * restarts, and after a cell ran (e.g. `%load_ext workbench`) while it was not
 * connected.
 */

import { ISessionContext } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { COMM_TARGET, KernelMessage } from './protocol';

/** Between two tries to open the comm while workbench is not loaded (a comm opened just
 * after one was closed can be given the subshell being deleted). */
const RETRY_MS = 2000;

export type ConnectionStatus = 'no-notebook' | 'no-kernel' | 'connecting' | 'not-loaded' | 'connected';

/** One id per browser tab, kept over reloads: the kernel closes the comm of the page it replaces. */
function clientId(): string {
  const key = 'workbench-panel-client';
  let id = window.sessionStorage.getItem(key);
  if (!id) {
    id = Math.random().toString(36).slice(2) + Date.now().toString(36);
    window.sessionStorage.setItem(key, id);
  }
  return id;
}

export class FleetConnection {
  private _notebook: NotebookPanel | null = null;
  private _comm: Kernel.IComm | null = null;
  private _status: ConnectionStatus = 'no-notebook';
  private _kernelId = '';
  private _lastAttempt = 0;
  private _messages = new Signal<this, KernelMessage>(this);
  private _statusChanged = new Signal<this, ConnectionStatus>(this);

  constructor(tracker: INotebookTracker) {
    tracker.currentChanged.connect((_, panel) => this._follow(panel), this);
    this._follow(tracker.currentWidget);
    window.addEventListener('beforeunload', () => this._comm?.close());
  }

  get messages(): ISignal<this, KernelMessage> {
    return this._messages;
  }

  get statusChanged(): ISignal<this, ConnectionStatus> {
    return this._statusChanged;
  }

  get status(): ConnectionStatus {
    return this._status;
  }

  get notebook(): NotebookPanel | null {
    return this._notebook;
  }

  /** The notebook's kernel is running something (a cell, or a command the panel sent). */
  get kernelBusy(): boolean {
    return this._notebook?.sessionContext.session?.kernel?.status === 'busy';
  }

  /** A cell of the notebook is running: a command waits until it finishes. */
  get cellRunning(): boolean {
    const cells = this._notebook?.content.widgets ?? [];
    return cells.some(cell => (cell.model as any).executionState === 'running');
  }

  /**
   * Run magics in the notebook's kernel, as if typed in a cell (on its main
   * shell, so after a cell that is running), without adding to the notebook.
   * `onOutput` gets what they printed so far, as it arrives (progress lines are
   * display updates: each replaces its earlier text). Resolves with all of it and
   * whether they succeeded.
   */
  async execute(code: string, onOutput?: (text: string) => void): Promise<{ ok: boolean; output: string }> {
    const kernel = this._notebook?.sessionContext.session?.kernel;
    if (!kernel) {
      throw new Error('this notebook has no kernel');
    }
    const parts: string[] = [];
    const displays = new Map<string, number>(); // display id -> its index in parts
    const text = () => parts.join('').replace(/\r/g, '\n').trim();
    const future = kernel.requestExecute({ code, silent: false, store_history: false });
    future.onIOPub = msg => {
      const content = msg.content as any;
      const type = msg.header.msg_type;
      if (type === 'stream') {
        parts.push(content.text);
      } else if (type === 'error') {
        parts.push(`${content.ename}: ${content.evalue}\n`);
      } else if (type === 'display_data' || type === 'update_display_data') {
        const plain = content.data?.['text/plain'];
        if (typeof plain !== 'string') {
          return;
        }
        const id = content.transient?.display_id;
        const index = id !== undefined ? displays.get(id) : undefined;
        if (index !== undefined) {
          parts[index] = plain + '\n';
        } else if (type === 'display_data') {
          if (id !== undefined) {
            displays.set(id, parts.length);
          }
          parts.push(plain + '\n');
        }
      } else {
        return;
      }
      onOutput?.(text());
    };
    const reply = await future.done;
    return { ok: reply.content.status === 'ok', output: text() };
  }

  /** Interrupt the notebook's kernel (the cell that runs stops on every rank). */
  async interrupt(): Promise<void> {
    const kernel = this._notebook?.sessionContext.session?.kernel;
    if (!kernel) {
      throw new Error('this notebook has no kernel');
    }
    await kernel.interrupt();
  }

  /** Open the comm if it is not open (e.g. after a command loaded workbench). */
  async reconnect(): Promise<void> {
    if (!this._comm) {
      await this._connect();
    }
  }

  private _follow(panel: NotebookPanel | null): void {
    if (panel === this._notebook) {
      return;
    }
    if (this._notebook) {
      this._notebook.sessionContext.statusChanged.disconnect(this._onKernelStatus, this);
      this._notebook.sessionContext.kernelChanged.disconnect(this._onKernelChanged, this);
    }
    this._disconnect();
    this._notebook = panel;
    if (!panel) {
      this._setStatus('no-notebook');
      return;
    }
    panel.sessionContext.statusChanged.connect(this._onKernelStatus, this);
    panel.sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    this._setStatus('connecting');
    void panel.sessionContext.ready.then(() => this._connect());
  }

  private _onKernelChanged(): void {
    const kernel = this._notebook?.sessionContext.session?.kernel;
    if (this._comm && kernel && this._kernelId === kernel.id) {
      return; // the same kernel: keep the comm
    }
    this._disconnect();
    void this._connect();
  }

  private _onKernelStatus(_: ISessionContext, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'dead') {
      this._disconnect();
      this._setStatus('no-kernel');
    } else if (status === 'idle' && !this._comm && Date.now() - this._lastAttempt > RETRY_MS) {
      void this._connect(); // e.g. `%load_ext workbench` just ran
    }
  }

  private async _connect(): Promise<void> {
    const notebook = this._notebook;
    const kernel = notebook?.sessionContext.session?.kernel;
    if (!notebook || !kernel) {
      this._setStatus(notebook ? 'no-kernel' : 'no-notebook');
      return;
    }
    if (this._comm) {
      return;
    }
    this._lastAttempt = Date.now();
    this._setStatus('connecting');
    const comm = kernel.createComm(COMM_TARGET);
    this._comm = comm;
    this._kernelId = kernel.id;
    comm.onMsg = msg => {
      if (this._comm === comm) {
        if (this._status !== 'connected') {
          this._setStatus('connected');
        }
        this._messages.emit(msg.content.data as unknown as KernelMessage);
      }
    };
    comm.onClose = () => {
      if (this._comm === comm) {
        // closed by the kernel: the target is not registered (workbench not loaded)
        this._comm = null;
        this._setStatus('not-loaded');
      }
    };
    try {
      // Open over the comm's own subshell where the kernel has them (ipykernel 7): the
      // kernel answers at once, also while a cell is running on its main shell.
      await kernel.info;
      if (kernel.supportsSubshells) {
        await Promise.race([(comm as any).subshellStarted, new Promise(resolve => setTimeout(resolve, 5000))]);
      }
      if (this._comm !== comm) {
        return;
      }
      await comm.open({ client: clientId() }).done;
    } catch (error) {
      if (this._comm === comm) {
        this._comm = null;
        this._setStatus('not-loaded');
      }
    }
  }

  private _disconnect(): void {
    const comm = this._comm;
    this._comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch (error) {
        // the kernel is gone already
      }
    }
  }

  private _setStatus(status: ConnectionStatus): void {
    this._status = status;
    this._statusChanged.emit(status);
  }
}
