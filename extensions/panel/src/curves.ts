/**
 * One run's curves for the panel, built from its records as they come (live from the
 * kernel, or from metrics.jsonl through the server routes): the first logged scalar
 * (`loss` when there is one) and throughput, a line per rank.
 */

import { Series } from './chart';
import { Point } from './protocol';

export class Curves {
  readonly loss = new Series();
  /** the scalar on the first chart: `loss` if logged, else the first one seen */
  scalarName: string | null = null;
  private _samples = new Series(); // samples/s as the ranks measured it: the forward's batch ÷ the step's time
  private _steps = new Series(); // 1 ÷ the step's time, for records without a sample count

  /** `scalarName`: follow this scalar (a compared run shows the same one as the shown run). */
  constructor(scalarName: string | null = null) {
    this.scalarName = scalarName;
  }

  /** samples/s where the ranks measured it (as the summary, wandb and TensorBoard), else steps/s */
  get throughputName(): string {
    return this._samples.size ? 'samples/s' : 'steps/s';
  }

  get throughput(): Series {
    return this._samples.size ? this._samples : this._steps;
  }

  add(points: Point[]): void {
    for (const [rank, step, , scalars, samplesPerS, stepTime] of points) {
      if (this.scalarName === null) {
        const names = Object.keys(scalars || {});
        this.scalarName = names.includes('loss') ? 'loss' : names[0] ?? null;
      }
      if (this.scalarName !== null && scalars && this.scalarName in scalars) {
        const value = scalars[this.scalarName]; // null: NaN or infinite (standard JSON has neither)
        this.loss.add(rank, step, value === null ? null : Number(value));
      }
      if (samplesPerS !== null && samplesPerS !== undefined) {
        this._samples.add(rank, step, samplesPerS);
      } else if (stepTime) {
        this._steps.add(rank, step, 1 / stepTime);
      }
    }
  }
}
