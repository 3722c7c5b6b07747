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

import { Action, COMM_TARGET, KernelMessage } from './protocol';

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
  private _nextId = 1;
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

  /** The kernel is running a cell: an action waits until it finishes. */
  get kernelBusy(): boolean {
    return this._notebook?.sessionContext.kernelDisplayStatus === 'busy';
  }

  /** Send a button's action; returns its id (the reply carries it). */
  send(action: Action, data: Record<string, unknown> = {}): number {
    if (!this._comm) {
      throw new Error('not connected to a workbench kernel');
    }
    const id = this._nextId++;
    this._comm.send({ action, id, ...data } as any);
    return id;
  }

  /** `%load_ext workbench` in the notebook's kernel, then connect. */
  async loadWorkbench(): Promise<void> {
    const kernel = this._notebook?.sessionContext.session?.kernel;
    if (!kernel) {
      throw new Error('this notebook has no kernel');
    }
    await kernel.requestExecute({ code: '%load_ext workbench', silent: true, store_history: false }).done;
    await this._connect();
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
    this._disconnect();
    void this._connect();
  }

  private _onKernelStatus(_: ISessionContext, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'dead') {
      this._disconnect();
      this._setStatus('no-kernel');
    } else if (status === 'idle' && !this._comm && Date.now() - this._lastAttempt > 500) {
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
