/**
 * The workbench server routes (workbench/labpanel.py): runs, checkpoints, metrics and
 * logs on disk. `folder` is the notebook's folder (relative to the server root): its
 * kernel writes workbench-runs/ there.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { ICheckpoint, ILogResponse, ILogsResponse, IMetricsResponse, IRunsResponse } from './protocol';

async function get<T>(path: string, folder: string, query: Record<string, string> = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const search = new URLSearchParams({ ...query, folder }).toString();
  const url = URLExt.join(settings.baseUrl, 'workbench/api', path) + '?' + search;
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response);
  }
  return (await response.json()) as T;
}

export function fetchRuns(folder: string): Promise<IRunsResponse> {
  return get<IRunsResponse>('runs', folder);
}

export function fetchCheckpoints(folder: string, run: string): Promise<{ run: string; checkpoints: ICheckpoint[] }> {
  return get(`runs/${encodeURIComponent(run)}/checkpoints`, folder);
}

export function fetchMetrics(folder: string, run: string, since: number): Promise<IMetricsResponse> {
  return get<IMetricsResponse>(`runs/${encodeURIComponent(run)}/metrics`, folder, { since: String(since) });
}

export function fetchLogs(folder: string, run: string): Promise<ILogsResponse> {
  return get<ILogsResponse>(`runs/${encodeURIComponent(run)}/logs`, folder);
}

export function fetchLog(folder: string, run: string, name: string): Promise<ILogResponse> {
  return get<ILogResponse>(`runs/${encodeURIComponent(run)}/logs/${encodeURIComponent(name)}`, folder);
}
