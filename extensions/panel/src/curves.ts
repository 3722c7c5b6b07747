/**
 * One run's curves for the panel, built from its records as they come (live from the
 * kernel, or from metrics.jsonl through the server routes): the first logged scalar
 * (`loss` when there is one) and throughput, a line per rank.
 */

import { Series } from './chart';
import { Point } from './protocol';

export class Curves {
  readonly loss = new Series();
  readonly throughput = new Series();
  /** the scalar on the first chart: `loss` if logged, else the first one seen */
  scalarName: string | null = null;
  /** samples/s where the ranks measured it (the forward's batch size ÷ the step's time), else steps/s */
  throughputName = 'samples/s';
  private _lastTime = new Map<number, number>();

  /** `scalarName`: follow this scalar (a compared run shows the same one as the shown run). */
  constructor(scalarName: string | null = null) {
    this.scalarName = scalarName;
  }

  add(points: Point[]): void {
    for (const [rank, step, time, scalars, samplesPerS] of points) {
      if (this.scalarName === null) {
        const names = Object.keys(scalars || {});
        this.scalarName = names.includes('loss') ? 'loss' : names[0] ?? null;
      }
      if (this.scalarName !== null && scalars && this.scalarName in scalars) {
        const value = scalars[this.scalarName]; // null: NaN or infinite (standard JSON has neither)
        this.loss.add(rank, step, value === null ? null : Number(value));
      }
      const previous = this._lastTime.get(rank);
      this._lastTime.set(rank, time);
      if (samplesPerS !== null && samplesPerS !== undefined) {
        this.throughputName = 'samples/s';
        this.throughput.add(rank, step, samplesPerS);
      } else if (previous !== undefined && time > previous) {
        this.throughputName = 'steps/s';
        this.throughput.add(rank, step, 1 / (time - previous));
      }
    }
  }
}
