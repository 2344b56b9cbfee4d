// The status view: the model, the server's memory and requests (/health, /v1/models,
// /props, /metrics) and a chart of speculation's acceptance over the last minutes.

const EVERY_MS = 5000;
const KEEP_MS = 10 * 60 * 1000;
const samples = []; // {time, accepted, drafted}: the counters' totals at each poll

// Prometheus text to {name: [{labels, value}]} (comments and histograms' lines included).
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(/(\w+)="([^"]*)"/g)) labels[k] = v;
    (out[m[1]] ||= []).push({ labels, value: Number(m[3]) });
  }
  return out;
}

const total = (metrics, name) => (metrics[name] || []).reduce((sum, s) => sum + s.value, 0);

function bytes(n) {
  if (!n) return "0 B";
  const unit = Math.min(4, Math.floor(Math.log(n) / Math.log(1024)));
  return `${(n / 1024 ** unit).toFixed(unit ? 1 : 0)} ${["B", "KiB", "MiB", "GiB", "TiB"][unit]}`;
}

function showFacts(facts) {
  const list = document.getElementById("status-facts");
  list.replaceChildren(...facts.flatMap(([term, value]) => {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = value;
    return [dt, dd];
  }));
}

// Acceptance (accepted / drafted) between consecutive samples, as a line over time.
function drawChart() {
  const canvas = document.getElementById("acceptance-chart");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  const style = getComputedStyle(canvas);
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = style.borderColor;
  ctx.fillStyle = style.color;
  ctx.font = "11px sans-serif";
  for (const level of [0, 0.5, 1]) {
    const y = height - 16 - level * (height - 28);
    ctx.beginPath();
    ctx.moveTo(32, y);
    ctx.lineTo(width, y);
    ctx.stroke();
    ctx.fillText(`${level * 100}%`, 0, y + 4);
  }
  const now = Date.now();
  const points = [];
  for (let i = 1; i < samples.length; i++) {
    const drafted = samples[i].drafted - samples[i - 1].drafted;
    if (drafted > 0) {
      const rate = (samples[i].accepted - samples[i - 1].accepted) / drafted;
      const x = 32 + (width - 32) * (1 - (now - samples[i].time) / KEEP_MS);
      points.push([x, height - 16 - rate * (height - 28)]);
    }
  }
  ctx.strokeStyle = style.outlineColor;
  ctx.lineWidth = 2;
  ctx.beginPath();
  points.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
  ctx.stroke();
  ctx.lineWidth = 1;
  for (const [x, y] of points) ctx.fillRect(x - 2, y - 2, 4, 4);
  if (!points.length) ctx.fillText("no speculation in the last 10 minutes", 40, height / 2);
}

async function poll(api) {
  const [health, models, props, metricsText] = await Promise.all([
    api("/health").then((r) => r.json()),
    api("/v1/models").then((r) => r.json()),
    api("/props").then((r) => (r.ok ? r.json() : {})),
    api("/metrics").then((r) => r.text()),
  ]);
  const metrics = parseMetrics(metricsText);
  const model = models.data[0];
  const value = (name) => total(metrics, name);
  samples.push({ time: Date.now(), accepted: value("mlxspec_accepted_tokens_total"),
                 drafted: value("mlxspec_drafted_tokens_total") });
  while (samples.length && samples[0].time < Date.now() - KEEP_MS) samples.shift();
  showFacts([
    ["Model", model.id],
    ["Backend", `MLX ${props.backend || "?"}` + (props.blas ? ` (${props.blas})` : "") +
                `, ${props.build_info || "mlxspec"}, speculation ${model.meta.mode}, ` +
                `${model.meta.num_draft} tokens a proposal`],
    ["Context", `${model.meta.n_ctx_train || "?"} tokens`],
    ["Status", health.status],
    ["Requests", `${value("mlxspec_requests_active")} in flight, ` +
                 `${value("mlxspec_requests_queued")} queued, ` +
                 `${value("mlxspec_requests_speculative_active")} speculating`],
    ["Memory", `${bytes(value("mlxspec_mlx_active_memory_bytes"))} active, ` +
               `${bytes(value("mlxspec_mlx_peak_memory_bytes"))} peak, ` +
               `${bytes(value("mlxspec_mlx_cache_memory_bytes"))} cached by MLX`],
    ["Prompt caches", `${value("mlxspec_prompt_cache_entries")} kept, ` +
                      `${bytes(value("mlxspec_prompt_cache_bytes"))}`],
    ["Generated", `${value("mlxspec_generated_tokens_total")} tokens, ` +
                  `${value("mlxspec_accepted_tokens_total")} of ` +
                  `${value("mlxspec_drafted_tokens_total")} proposed accepted`],
  ]);
  drawChart();
}

export function startStatus(api) {
  const tick = () => poll(api).catch(() => {}); // a server restarting: the next poll tries again
  tick();
  setInterval(tick, EVERY_MS);
}
