/**
 * What the kernel sends the panel over its comm (workbench/panel.py), and the
 * JSON of the server routes (workbench/labpanel.py). The panel's buttons do not
 * use the comm: they run magics in the kernel (see FleetConnection.execute).
 */

export const COMM_TARGET = 'workbench.panel';

export interface IEngine {
  rank: number;
  engine: number;
  pid: number;
  host: string;
  device: string;
  state: string; // starting | idle | busy | dead | silent
  memory_mb: number | null;
}

export interface ICheckpoint {
  tag: string;
  state: string; // complete | writing
  step?: number;
  world_size?: number;
  strategy?: string;
  created?: number;
}

export interface IFleetState {
  type: 'state';
  running: boolean;
  run: string | null;
  world_size?: number;
  backend?: string;
  engines: IEngine[];
  spares: { ready: number; starting: number };
  checkpoints: ICheckpoint[];
  needs_recover?: boolean; // a rank was replaced by a fresh engine: %fleet recover next
  parked?: { world: number; tag: string; since: number } | null; // %fleet park: no engines until unparked
  last_cell?: ILastCell | null; // the newest cell that ended
}

/** The newest %%distributed cell that ended (from the run's record) */
export interface ILastCell {
  cell: string;
  status: string; // ok | failed | interrupted
  seconds: number;
  ended: number;
  long: boolean; // it ran at least a minute (workbench.panel.LONG_CELL_S): the panel says it ended
}

/** [rank, step, time, scalars (null: NaN or infinite), samples_per_s, step_time_s] */
export type Point = [number, number, number, Record<string, number | null>, number | null, number | null];

export interface IMetricsMessage {
  type: 'metrics';
  run: string;
  points: Point[];
}

export type KernelMessage = IFleetState | IMetricsMessage;

/** GET workbench/api/runs */
export interface IRunsResponse {
  root: string;
  runs: {
    id: string;
    modified: number;
    checkpoints: number;
    metrics: boolean;
    /** from the run's run.json (absent for runs made before it existed) */
    name?: string;
    status?: string;
    duration_s?: number | null;
    loss?: number | string | null;
  }[];
}

/** GET workbench/api/runs/<id>/metrics?since=N (records as in metrics.jsonl) */
export interface IMetricsResponse {
  run: string;
  next: number;
  records: {
    time: number;
    rank: number;
    step: number;
    scalars: Record<string, number | null>;
    system: Record<string, number>;
  }[];
}

/** GET workbench/api/runs/<id>/logs */
export interface ILogsResponse {
  run: string;
  logs: { name: string; size: number }[];
}

/** GET workbench/api/runs/<id>/logs/<name>: the file's last 64 KB */
export interface ILogResponse {
  run: string;
  name: string;
  size: number;
  text: string;
  cut: boolean;
}
