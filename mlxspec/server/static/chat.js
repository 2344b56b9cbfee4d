// The chat page: a conversation kept in this browser (localStorage), replies streamed from
// /v1/chat/completions with "speculative": {"sources": true}, each reply's text coloured by
// where its tokens came from, and its speculation figures under it.
import { renderMarkdown } from "./markdown.js";
import { startStatus } from "./status.js";

const STORE = "mlxspec.chat"; // {messages, settings}
const KEY_STORE = "mlxspec.apiKey";
const MODES = ["auto", "ngram", "draft", "suffix", "lookahead", "quantspec", "none"];
const SOURCES = { // a token's source: the legend's words
  target: "target's own forward",
  ngram: "prompt lookup (n-gram)",
  draft: "draft model",
  suffix: "suffix (earlier text)",
  lookahead: "lookahead",
  quantspec: "QuantSpec",
};

const $ = (id) => document.getElementById(id);
let state = load();
let running = null; // the AbortController of the reply being streamed

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE));
    if (saved && Array.isArray(saved.messages)) return saved;
  } catch { /* a broken entry: start afresh */ }
  return { messages: [], settings: { system: "", temperature: 0, maxTokens: 512, mode: "auto", colour: true } };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

// -- the API, with the key this browser keeps (asked for when a call answers 401)
async function api(path, options = {}) {
  for (;;) {
    const key = localStorage.getItem(KEY_STORE);
    const headers = { ...(options.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    localStorage.setItem(KEY_STORE, await askKey());
  }
}

let asking = null; // the key dialog's answer, shared by the calls waiting for it

function askKey() {
  const dialog = $("key-dialog");
  asking ||= new Promise((resolve) => {
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      dialog.close();
      asking = null;
      resolve($("key").value.trim());
    };
    dialog.showModal();
  });
  return asking;
}

// -- showing messages
function sourceClass(source) {
  return `src src-${SOURCES[source] ? source : "other"}`;
}

// [start, end) of each fenced code block's code in `text` (the fence lines left out; a
// fence still open runs to the end).
function codeRanges(text) {
  const ranges = [];
  let open = null;
  let pos = 0;
  for (const line of text.split("\n")) {
    if (/^\s*```/.test(line)) {
      if (open === null) {
        open = pos + line.length + 1;
      } else {
        ranges.push([open, pos]);
        open = null;
      }
    }
    pos += line.length + 1;
  }
  if (open !== null) ranges.push([open, text.length]);
  return ranges;
}

// A reply as its coloured spans: prose wrapped, code blocks in monospace.
function renderSources(spans, body) {
  const ranges = codeRanges(spans.map(([text]) => text).join(""));
  const inCode = (at) => ranges.some(([start, end]) => at >= start && at < end);
  const edges = ranges.flat();
  let block = null;
  let at = 0;
  for (const [text, source] of spans) {
    // split the span where a code block starts or ends
    const cuts = [0, ...edges.filter((e) => e > at && e < at + text.length).map((e) => e - at), text.length];
    for (let i = 0; i + 1 < cuts.length; i++) {
      const code = inCode(at + cuts[i]);
      if (!block || block.code !== code) {
        block = { code, element: document.createElement(code ? "pre" : "div") };
        block.element.className = code ? "code-sources" : "prose-sources";
        body.append(block.element);
      }
      const span = document.createElement("span");
      span.className = sourceClass(source);
      span.dataset.source = source;
      span.textContent = text.slice(cuts[i], cuts[i + 1]);
      block.element.append(span);
    }
    at += text.length;
  }
}

function renderBody(message, body) {
  body.replaceChildren();
  const coloured = message.role === "assistant" && state.settings.colour && message.spans;
  body.classList.toggle("sources", Boolean(coloured));
  if (coloured) renderSources(message.spans, body);
  else body.innerHTML = renderMarkdown(message.content); // escaped by renderMarkdown
}

// Where a reply's proposals came from, in order, each stretch once ("suffix → ngram").
function stretches(spans) {
  const order = [];
  for (const [, source] of spans || []) {
    if (source !== "target" && order[order.length - 1] !== source) order.push(source);
  }
  return order.join(" → ");
}

function statsText(message) {
  const usage = message.usage;
  if (!usage) return message.stopped ? "stopped" : message.error ? `error: ${message.error}` : "streaming…";
  const spec = usage.speculative || {};
  const n = usage.completion_tokens;
  const parts = [`${n} tokens`];
  if (spec.target_forwards) parts.push(`${(n / spec.target_forwards).toFixed(2)} tokens/forward`);
  parts.push(`acceptance ${(100 * (spec.acceptance_rate || 0)).toFixed(0)}% ` +
             `(${spec.accepted_tokens || 0}/${spec.drafted_tokens || 0})`);
  const tps = message.timings && message.timings.predicted_per_second;
  if (tps) parts.push(`${tps.toFixed(1)} tok/s`);
  const chosen = stretches(message.spans);
  parts.push(`mode ${spec.mode || "?"}${spec.mode === "auto" && chosen ? `: ${chosen}` : ""}`);
  if (message.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function renderStats(message, stats) {
  stats.textContent = statsText(message);
  const spec = (message.usage && message.usage.speculative) || {};
  stats.dataset.accepted = spec.accepted_tokens ?? "";
  stats.dataset.drafted = spec.drafted_tokens ?? "";
  stats.dataset.forwards = spec.target_forwards ?? "";
  stats.dataset.tokens = message.usage ? message.usage.completion_tokens : "";
}

function messageView(message) {
  const view = document.createElement("article");
  view.className = `message ${message.role}`;
  const body = document.createElement("div");
  body.className = "body";
  view.append(body);
  renderBody(message, body);
  if (message.role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    view.append(stats);
    renderStats(message, stats);
  }
  return view;
}

function renderAll() {
  $("messages").replaceChildren(...state.messages.map(messageView));
  $("messages").scrollTop = $("messages").scrollHeight;
}

function renderLegend() {
  $("legend").replaceChildren(...Object.entries(SOURCES).map(([source, words]) => {
    const item = document.createElement("span");
    item.className = sourceClass(source);
    item.textContent = words;
    return item;
  }));
}

// -- a reply, streamed
async function* serverEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
      }
    }
  }
}

function requestBody() {
  const s = state.settings;
  const messages = state.messages.filter((m) => !m.error && m.content)
    .map((m) => ({ role: m.role, content: m.content }));
  if (s.system.trim()) messages.unshift({ role: "system", content: s.system });
  return {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: Number(s.temperature), max_tokens: Number(s.maxTokens),
    speculative: { mode: s.mode, sources: true },
  };
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  const body = requestBody();
  const reply = { role: "assistant", content: "", spans: [] };
  state.messages.push(reply);
  save();
  renderAll();
  const view = $("messages").lastElementChild;
  const [replyBody, stats] = [view.querySelector(".body"), view.querySelector(".stats")];
  running = new AbortController();
  setRunning(true);
  let drawn = false;
  const draw = () => {
    drawn = false;
    renderBody(reply, replyBody);
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
    }
    for await (const chunk of serverEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        reply.content += delta.content;
        reply.spans.push(...(delta.sources || [[delta.content, "target"]]));
        if (!drawn) requestAnimationFrame(draw);
        drawn = true;
      }
      if (chunk.usage) [reply.usage, reply.timings] = [chunk.usage, chunk.timings];
    }
  } catch (error) {
    if (error.name === "AbortError") reply.stopped = true;
    else reply.error = error.message;
  } finally {
    running = null;
    setRunning(false);
    save();
    draw();
    renderStats(reply, stats);
  }
}

function setRunning(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  document.body.classList.toggle("streaming", on);
}

// -- settings and controls
function bindSettings() {
  const s = state.settings;
  $("mode").replaceChildren(...MODES.map((m) => new Option(m, m)));
  const fields = { system: "system", temperature: "temperature", "max-tokens": "maxTokens", mode: "mode" };
  for (const [id, key] of Object.entries(fields)) {
    $(id).value = s[key];
    $(id).addEventListener("change", () => { s[key] = $(id).value; save(); });
  }
  $("colour").checked = s.colour;
  $("colour").addEventListener("change", () => { s.colour = $("colour").checked; save(); renderAll(); });
}

function bindControls() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value.trim();
    if (!text || running) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("new-chat").addEventListener("click", () => {
    if (running) running.abort();
    state.messages = [];
    save();
    renderAll();
  });
  $("messages").addEventListener("click", async (event) => {
    const button = event.target.closest("button.copy");
    if (!button) return;
    await navigator.clipboard.writeText(button.parentElement.querySelector("code").textContent);
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  const show = (chat) => {
    $("chat-view").hidden = !chat;
    $("status-view").hidden = chat;
    $("show-chat").classList.toggle("active", chat);
    $("show-status").classList.toggle("active", !chat);
  };
  $("show-chat").addEventListener("click", () => show(true));
  $("show-status").addEventListener("click", () => show(false));
}

async function showModel() {
  const response = await api("/v1/models");
  if (!response.ok) return;
  const model = (await response.json()).data[0];
  $("model-name").textContent = `${model.id} · server mode ${model.meta.mode}`;
}

bindSettings();
bindControls();
renderLegend();
renderAll();
showModel();
startStatus(api);
