/**
 * Per-rank curves drawn as SVG polylines: one chart per metric, one line per rank.
 */

const COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f'];
const MAX_POINTS = 2000; // per rank; older points are thinned out beyond this
const SVG = 'http://www.w3.org/2000/svg';

const MAX_NON_FINITE = 100; // NaN / infinite values kept to mark

export class Series {
  readonly byRank = new Map<number, [number, number][]>();
  /** steps where a rank logged NaN or an infinite value (null on the wire), first ones first */
  readonly nonFinite: { rank: number; x: number }[] = [];

  add(rank: number, x: number, y: number | null): void {
    if (y === null || !Number.isFinite(y)) {
      if (this.nonFinite.length < MAX_NON_FINITE) {
        this.nonFinite.push({ rank, x });
      }
      return;
    }
    let points = this.byRank.get(rank);
    if (!points) {
      points = [];
      this.byRank.set(rank, points);
    }
    points.push([x, y]);
    if (points.length > MAX_POINTS) {
      this.byRank.set(rank, thin(points));
    }
  }

  clear(): void {
    this.byRank.clear();
    this.nonFinite.length = 0;
  }

  get size(): number {
    let n = 0;
    this.byRank.forEach(p => (n += p.length));
    return n;
  }
}

/**
 * Half the points: of each four, the lowest and the highest (in step order), so spikes stay
 * on the chart; the newest point is kept.
 */
function thin(points: [number, number][]): [number, number][] {
  const out: [number, number][] = [];
  for (let i = 0; i < points.length - 1; i += 4) {
    const bucket = points.slice(i, Math.min(i + 4, points.length - 1));
    let low = 0,
      high = 0;
    bucket.forEach(([, y], j) => {
      if (y < bucket[low][1]) {
        low = j;
      }
      if (y > bucket[high][1]) {
        high = j;
      }
    });
    for (const j of low === high ? [low] : [Math.min(low, high), Math.max(low, high)]) {
      out.push(bucket[j]);
    }
  }
  out.push(points[points.length - 1]);
  return out;
}

/** The value below which a share `q` of the sorted `values` lie. */
function quantile(sorted: number[], q: number): number {
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.round(q * (sorted.length - 1))))];
}

function format(value: number): string {
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 0.01 || abs >= 1e5)) {
    return value.toExponential(2);
  }
  return value.toFixed(abs < 10 ? 3 : 1);
}

function svgText(x: number, y: number, text: string, anchor: string): SVGTextElement {
  const node = document.createElementNS(SVG, 'text');
  node.setAttribute('x', String(x));
  node.setAttribute('y', String(y));
  node.setAttribute('text-anchor', anchor);
  node.setAttribute('class', 'wb-chart-tick');
  node.textContent = text;
  return node;
}

function svgLine(x1: number, y1: number, x2: number, y2: number, className: string): SVGLineElement {
  const node = document.createElementNS(SVG, 'line');
  for (const [name, value] of [['x1', x1], ['y1', y1], ['x2', x2], ['y2', y2]] as [string, number][]) {
    node.setAttribute(name, value.toFixed(1));
  }
  node.setAttribute('class', className);
  return node;
}

/**
 * Replace the content of `host` with a chart of `series`: a line per rank, a y axis
 * with three ticks (the unit is in the title), the step range on the x axis, and a
 * legend below with each rank's last value.
 */
export function drawChart(host: HTMLElement, title: string, series: Series): void {
  host.textContent = '';
  const heading = document.createElement('div');
  heading.className = 'wb-chart-title';
  host.appendChild(heading);
  const bad = series.nonFinite[0];
  if (bad) {
    // named once, like the cell output's note: 'loss is nan at step 412 on rank 1'
    const note = document.createElement('div');
    note.className = 'wb-chart-nonfinite-note';
    note.textContent =
      `${title} is NaN or infinite at step ${bad.x} on rank ${bad.rank}` +
      (series.nonFinite.length > 1 ? ` (${series.nonFinite.length} such values)` : '');
    host.appendChild(note);
  }
  if (series.size === 0) {
    heading.textContent = `${title}: no data yet`;
    return;
  }
  let xmin = Infinity,
    xmax = -Infinity;
  const ys: number[] = [];
  series.byRank.forEach(points =>
    points.forEach(([x, y]) => {
      xmin = Math.min(xmin, x);
      xmax = Math.max(xmax, x);
      ys.push(y);
    })
  );
  // the y axis spans 99 % of the points (a warm-up step or a spike does not flatten the rest);
  // points beyond it are drawn at its edge and counted in the title
  ys.sort((a, b) => a - b);
  const ymin = quantile(ys, 0.005),
    ymax = quantile(ys, 0.995);
  const off = ys.filter(y => y < ymin || y > ymax).length;
  for (const { x } of series.nonFinite) {
    // the steps of NaN / infinite values are in the range, so that their marks show
    xmin = Math.min(xmin, x);
    xmax = Math.max(xmax, x);
  }
  heading.textContent = off ? `${title} · ${off} point${off > 1 ? 's' : ''} off the chart` : title;
  // drawn at the box's real pixel width, so the text is the size the stylesheet says
  const width = Math.max(160, Math.round(host.clientWidth) || 300),
    height = 110,
    left = 46,
    right = 6,
    top = 6,
    bottom = 16;
  const sx = (x: number) => left + ((x - xmin) / (xmax - xmin || 1)) * (width - left - right);
  const sy = (y: number) =>
    height - bottom - ((Math.min(ymax, Math.max(ymin, y)) - ymin) / (ymax - ymin || 1)) * (height - top - bottom);
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  svg.setAttribute('class', 'wb-chart');
  svg.setAttribute('data-points', String(series.size));
  for (const y of [ymin, (ymin + ymax) / 2, ymax]) {
    svg.appendChild(svgLine(left, sy(y), width - right, sy(y), 'wb-chart-grid'));
    svg.appendChild(svgText(left - 4, sy(y) + 3, format(y), 'end'));
  }
  svg.appendChild(svgLine(left, top, left, height - bottom, 'wb-chart-axis-line'));
  svg.appendChild(svgLine(left, height - bottom, width - right, height - bottom, 'wb-chart-axis-line'));
  svg.appendChild(svgText(left, height - 3, `step ${xmin}`, 'start'));
  svg.appendChild(svgText(width - right, height - 3, String(xmax), 'end'));
  for (const { x } of series.nonFinite) {
    svg.appendChild(svgLine(sx(x), top, sx(x), height - bottom, 'wb-chart-nonfinite'));
  }
  series.byRank.forEach((points, rank) => {
    const line = document.createElementNS(SVG, 'polyline');
    line.setAttribute('points', points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(' '));
    line.setAttribute('stroke', COLORS[rank % COLORS.length]);
    line.setAttribute('data-rank', String(rank));
    svg.appendChild(line);
  });
  host.appendChild(svg);
  const legend = document.createElement('div');
  legend.className = 'wb-legend';
  [...series.byRank.keys()].sort((a, b) => a - b).forEach(rank => {
    const points = series.byRank.get(rank)!;
    const item = document.createElement('span');
    item.className = 'wb-legend-item';
    item.dataset.rank = String(rank);
    const swatch = document.createElement('span');
    swatch.className = 'wb-legend-swatch';
    swatch.style.background = COLORS[rank % COLORS.length];
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(`rank ${rank}: ${format(points[points.length - 1][1])}`));
    legend.appendChild(item);
  });
  host.appendChild(legend);
}
