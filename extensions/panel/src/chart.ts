/**
 * Per-rank curves drawn as SVG polylines: one chart per metric, one line per rank.
 */

const COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f'];
const MAX_POINTS = 2000; // per rank; older points are thinned out beyond this
const SVG = 'http://www.w3.org/2000/svg';

export class Series {
  readonly byRank = new Map<number, [number, number][]>();

  add(rank: number, x: number, y: number): void {
    if (!Number.isFinite(y)) {
      return;
    }
    let points = this.byRank.get(rank);
    if (!points) {
      points = [];
      this.byRank.set(rank, points);
    }
    points.push([x, y]);
    if (points.length > MAX_POINTS) {
      this.byRank.set(
        rank,
        points.filter((_, i) => i % 2 === 0 || i === points!.length - 1)
      );
    }
  }

  clear(): void {
    this.byRank.clear();
  }

  get size(): number {
    let n = 0;
    this.byRank.forEach(p => (n += p.length));
    return n;
  }
}

function format(value: number): string {
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 0.01 || abs >= 1e5)) {
    return value.toExponential(2);
  }
  return value.toFixed(abs < 10 ? 3 : 1);
}

/** Replace the content of `host` with a chart of `series`. */
export function drawChart(host: HTMLElement, title: string, series: Series): void {
  host.textContent = '';
  const heading = document.createElement('div');
  heading.className = 'wb-chart-title';
  host.appendChild(heading);
  if (series.size === 0) {
    heading.textContent = `${title}: no data yet`;
    return;
  }
  let xmin = Infinity,
    xmax = -Infinity,
    ymin = Infinity,
    ymax = -Infinity;
  series.byRank.forEach(points =>
    points.forEach(([x, y]) => {
      xmin = Math.min(xmin, x);
      xmax = Math.max(xmax, x);
      ymin = Math.min(ymin, y);
      ymax = Math.max(ymax, y);
    })
  );
  const last: string[] = [];
  series.byRank.forEach((points, rank) => last.push(`r${rank} ${format(points[points.length - 1][1])}`));
  heading.textContent = `${title} (${last.join(', ')})`;
  const width = 260,
    height = 90,
    pad = 2;
  const sx = (x: number) => pad + ((x - xmin) / (xmax - xmin || 1)) * (width - 2 * pad);
  const sy = (y: number) => height - pad - ((y - ymin) / (ymax - ymin || 1)) * (height - 2 * pad);
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  svg.setAttribute('class', 'wb-chart');
  svg.setAttribute('data-points', String(series.size));
  series.byRank.forEach((points, rank) => {
    const line = document.createElementNS(SVG, 'polyline');
    line.setAttribute('points', points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(' '));
    line.setAttribute('stroke', COLORS[rank % COLORS.length]);
    line.setAttribute('data-rank', String(rank));
    svg.appendChild(line);
  });
  host.appendChild(svg);
  const axis = document.createElement('div');
  axis.className = 'wb-chart-axis';
  axis.textContent = `step ${xmin}–${xmax} · ${format(ymin)} – ${format(ymax)}`;
  host.appendChild(axis);
}
