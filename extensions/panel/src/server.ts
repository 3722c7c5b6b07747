/** The workbench server routes (workbench/labpanel.py): runs and checkpoints on disk. */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { ICheckpoint, IMetricsResponse, IRunsResponse } from './protocol';

async function get<T>(path: string): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'workbench/api', path);
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response);
  }
  return (await response.json()) as T;
}

export function fetchRuns(): Promise<IRunsResponse> {
  return get<IRunsResponse>('runs');
}

export function fetchCheckpoints(run: string): Promise<{ run: string; checkpoints: ICheckpoint[] }> {
  return get(`runs/${encodeURIComponent(run)}/checkpoints`);
}

export function fetchMetrics(run: string, since: number): Promise<IMetricsResponse> {
  return get<IMetricsResponse>(`runs/${encodeURIComponent(run)}/metrics?since=${since}`);
}
