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

/** Another run's curves drawn under the shown run's, dashed (the panel's "compare"). */
export interface IOverlay {
  label: string;
  series: Series;
}

const HEIGHT = 110,
  LEFT = 46,
  RIGHT = 6,
  TOP = 6,
  BOTTOM = 16;

/** The points of `points` (sorted by x) with x in [lo, hi]. */
function within(points: [number, number][], lo: number, hi: number): [number, number][] {
  return points.filter(([x]) => x >= lo && x <= hi);
}

/** The point of `points` (sorted by x) nearest to `x`. */
function nearest(points: [number, number][], x: number): [number, number] | null {
  if (!points.length) {
    return null;
  }
  let lo = 0,
    hi = points.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const before = points[Math.max(0, lo - 1)];
  return Math.abs(before[0] - x) < Math.abs(points[lo][0] - x) ? before : points[lo];
}

/**
 * One chart in a box: a line per rank, a y axis with three ticks (the unit is in the
 * title), the step range on the x axis, a legend below with each rank's last value.
 * Hovering shows each rank's value at the step under the pointer; dragging across
 * zooms into those steps (the y axis follows), a double click or "all steps" zooms out.
 * The zoom and the pointer outlive redraws (the charts redraw as records arrive).
 */
export class Chart {
  private _zoom: [number, number] | null = null;
  private _drag: number | null = null; // the pixel x where a drag started
  private _pointer: number | null = null; // the pointer's pixel x over the plot
  private _scale: { sx: (x: number) => number; ix: (px: number) => number; width: number } | null = null;
  private _last: { title: string; series: Series; overlay: IOverlay | null } | null = null;

  constructor(readonly host: HTMLElement) {
    host.classList.add('wb-chart-host');
    const pixel = (event: MouseEvent) => {
      const svg = host.querySelector('svg.wb-chart');
      return svg ? event.clientX - svg.getBoundingClientRect().left : null;
    };
    host.addEventListener('mousedown', event => {
      const px = pixel(event);
      if (px !== null && px >= LEFT && event.button === 0) {
        this._drag = px;
        event.preventDefault();
      }
    });
    host.addEventListener('mousemove', event => {
      this._pointer = pixel(event);
      this._decorate();
    });
    host.addEventListener('mouseleave', () => {
      this._pointer = null;
      this._drag = null;
      this._decorate();
    });
    host.addEventListener('mouseup', event => {
      const px = pixel(event);
      const start = this._drag;
      this._drag = null;
      if (start !== null && px !== null && this._scale && Math.abs(px - start) > 4) {
        const [a, b] = [this._scale.ix(Math.min(start, px)), this._scale.ix(Math.max(start, px))];
        this._zoom = [a, b];
        this.redraw();
      } else {
        this._decorate();
      }
    });
    host.addEventListener('dblclick', () => this.zoomOut());
  }

  get zoom(): [number, number] | null {
    return this._zoom;
  }

  zoomOut(): void {
    this._zoom = null;
    this.redraw();
  }

  /** Another run is shown: all its steps, drawn at the next draw. */
  reset(): void {
    this._zoom = null;
    this._drag = null;
  }

  redraw(): void {
    if (this._last) {
      this.draw(this._last.title, this._last.series, this._last.overlay);
    }
  }

  /** Replace the box's content with a chart of `series` (and `overlay`, dashed). */
  draw(title: string, series: Series, overlay: IOverlay | null = null): void {
    this._last = { title, series, overlay };
    const host = this.host;
    host.textContent = '';
    this._scale = null;
    const header = document.createElement('div');
    header.className = 'wb-chart-header';
    const heading = document.createElement('span');
    heading.className = 'wb-chart-title';
    header.appendChild(heading);
    host.appendChild(header);
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
    const others = overlay ? [...overlay.series.byRank.values()] : [];
    if (series.size === 0 && !others.some(p => p.length)) {
      heading.textContent = `${title}: no data yet`;
      return;
    }
    let xmin = Infinity,
      xmax = -Infinity;
    for (const points of [...series.byRank.values(), ...others]) {
      for (const [x] of points) {
        xmin = Math.min(xmin, x);
        xmax = Math.max(xmax, x);
      }
    }
    for (const { x } of series.nonFinite) {
      // the steps of NaN / infinite values are in the range, so that their marks show
      xmin = Math.min(xmin, x);
      xmax = Math.max(xmax, x);
    }
    if (this._zoom) {
      [xmin, xmax] = this._zoom;
      const reset = document.createElement('button');
      reset.className = 'wb-chart-reset';
      reset.textContent = 'all steps';
      reset.title = 'zoom out (or double-click the chart)';
      reset.onclick = () => this.zoomOut();
      header.appendChild(reset);
    }
    const shown = new Map<number, [number, number][]>();
    series.byRank.forEach((points, rank) => shown.set(rank, within(points, xmin, xmax)));
    const shownOverlay = new Map<number, [number, number][]>();
    overlay?.series.byRank.forEach((points, rank) => shownOverlay.set(rank, within(points, xmin, xmax)));
    // the y axis spans 99 % of the shown points (a warm-up step or a spike does not flatten the
    // rest); points beyond it are drawn at its edge and counted in the title
    const ys: number[] = [];
    for (const points of [...shown.values(), ...shownOverlay.values()]) {
      points.forEach(([, y]) => ys.push(y));
    }
    ys.sort((a, b) => a - b);
    const ymin = ys.length ? quantile(ys, 0.005) : 0,
      ymax = ys.length ? quantile(ys, 0.995) : 1;
    const off = ys.filter(y => y < ymin || y > ymax).length;
    heading.textContent = off ? `${title} · ${off} point${off > 1 ? 's' : ''} off the chart` : title;
    // drawn at the box's real pixel width, so the text is the size the stylesheet says
    const width = Math.max(160, Math.round(host.clientWidth) || 300);
    const sx = (x: number) => LEFT + ((x - xmin) / (xmax - xmin || 1)) * (width - LEFT - RIGHT);
    const ix = (px: number) => xmin + ((px - LEFT) / (width - LEFT - RIGHT)) * (xmax - xmin || 1);
    const sy = (y: number) =>
      HEIGHT - BOTTOM - ((Math.min(ymax, Math.max(ymin, y)) - ymin) / (ymax - ymin || 1)) * (HEIGHT - TOP - BOTTOM);
    this._scale = { sx, ix, width };
    const svg = document.createElementNS(SVG, 'svg');
    svg.setAttribute('viewBox', `0 0 ${width} ${HEIGHT}`);
    svg.setAttribute('class', 'wb-chart');
    svg.setAttribute('data-points', String(series.size));
    svg.setAttribute('data-xmin', String(xmin));
    svg.setAttribute('data-xmax', String(xmax));
    for (const y of [ymin, (ymin + ymax) / 2, ymax]) {
      svg.appendChild(svgLine(LEFT, sy(y), width - RIGHT, sy(y), 'wb-chart-grid'));
      svg.appendChild(svgText(LEFT - 4, sy(y) + 3, format(y), 'end'));
    }
    svg.appendChild(svgLine(LEFT, TOP, LEFT, HEIGHT - BOTTOM, 'wb-chart-axis-line'));
    svg.appendChild(svgLine(LEFT, HEIGHT - BOTTOM, width - RIGHT, HEIGHT - BOTTOM, 'wb-chart-axis-line'));
    svg.appendChild(svgText(LEFT, HEIGHT - 3, `step ${Math.round(xmin)}`, 'start'));
    svg.appendChild(svgText(width - RIGHT, HEIGHT - 3, String(Math.round(xmax)), 'end'));
    for (const { x } of series.nonFinite) {
      if (x >= xmin && x <= xmax) {
        svg.appendChild(svgLine(sx(x), TOP, sx(x), HEIGHT - BOTTOM, 'wb-chart-nonfinite'));
      }
    }
    const polyline = (points: [number, number][], rank: number, className: string) => {
      const line = document.createElementNS(SVG, 'polyline');
      line.setAttribute('points', points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(' '));
      line.setAttribute('stroke', COLORS[rank % COLORS.length]);
      line.setAttribute('data-rank', String(rank));
      if (className) {
        line.setAttribute('class', className);
      }
      svg.appendChild(line);
    };
    shownOverlay.forEach((points, rank) => polyline(points, rank, 'wb-chart-overlay'));
    shown.forEach((points, rank) => polyline(points, rank, ''));
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
    if (overlay) {
      const item = document.createElement('span');
      item.className = 'wb-legend-item wb-legend-overlay';
      const swatch = document.createElement('span');
      swatch.className = 'wb-legend-swatch wb-legend-dashed';
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(`dashed: ${overlay.label}`));
      legend.appendChild(item);
    }
    host.appendChild(legend);
    this._decorate();
  }

  /** The pointer's step and values (a guide line and a tip), and the drag's selection. */
  private _decorate(): void {
    const svg = this.host.querySelector('svg.wb-chart');
    this.host.querySelectorAll('.wb-chart-cursor, .wb-chart-selection, .wb-chart-tip').forEach(n => n.remove());
    const scale = this._scale;
    const px = this._pointer;
    if (!svg || !scale || !this._last || px === null || px < LEFT || px > scale.width - RIGHT) {
      return;
    }
    if (this._drag !== null) {
      const rect = document.createElementNS(SVG, 'rect');
      rect.setAttribute('x', String(Math.min(this._drag, px)));
      rect.setAttribute('y', String(TOP));
      rect.setAttribute('width', String(Math.abs(px - this._drag)));
      rect.setAttribute('height', String(HEIGHT - TOP - BOTTOM));
      rect.setAttribute('class', 'wb-chart-selection');
      svg.appendChild(rect);
    }
    const x = scale.ix(px);
    const lines: string[] = [];
    let step: number | null = null;
    const { series, overlay } = this._last;
    for (const rank of [...series.byRank.keys()].sort((a, b) => a - b)) {
      const point = nearest(series.byRank.get(rank)!, x);
      if (point) {
        step = step ?? point[0];
        lines.push(`rank ${rank}: ${format(point[1])}` + (point[0] !== step ? ` (step ${point[0]})` : ''));
      }
    }
    for (const [rank, points] of overlay?.series.byRank ?? []) {
      const point = nearest(points, x);
      if (point) {
        lines.push(`${overlay!.label} rank ${rank}: ${format(point[1])} (step ${point[0]})`);
      }
    }
    if (step === null) {
      return;
    }
    svg.appendChild(svgLine(scale.sx(step), TOP, scale.sx(step), HEIGHT - BOTTOM, 'wb-chart-cursor'));
    const tip = document.createElement('div');
    tip.className = 'wb-chart-tip';
    tip.textContent = [`step ${step}`, ...lines].join('\n');
    tip.style.left = `${Math.min(px + 8, scale.width - 150)}px`;
    this.host.appendChild(tip);
  }
}
