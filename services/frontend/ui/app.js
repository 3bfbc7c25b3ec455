// kvflow web UI: a chat playground and a live engine view. Hand-written, no build step,
// no framework, no network but this server (docs/design.md, "Web UI").
"use strict";

const KEY_STORAGE = "kvflow-api-key";
const $ = (id) => document.getElementById(id);

// ---- API: fetch with the key, and an SSE reader over fetch (EventSource sends no headers)

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: "Bearer " + key } : {};
}

class AuthError extends Error {}

async function api(path, options = {}) {
  const headers = { ...authHeaders(), ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    showKeyDialog("The server refused the key: enter a valid one.");
    throw new AuthError("missing or invalid API key");
  }
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

// Calls onEvent(parsed JSON) for each `data:` event until [DONE] or the end of the body.
async function readSSE(response, onEvent) {
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
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// ---- API key

function showKeyDialog(message) {
  $("key-error").textContent = message || "";
  $("key-dialog").hidden = false;
  $("key-input").focus();
}

// The base model and its LoRA adapters (`parent` names the base): a request's `model`.
function fillModelPicker(models) {
  const picker = $("model-picker");
  const previous = state.model;
  picker.replaceChildren(...models.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.parent ? m.id + " (LoRA of " + m.parent + ")" : m.id;
    return option;
  }));
  picker.hidden = models.length < 2;
  const ids = models.map((m) => m.id);
  state.model = ids.includes(previous) ? previous : ids[0];
  if (state.model !== undefined) picker.value = state.model;
  showModel();
}

function showModel() {
  $("model-name").textContent = state.model !== undefined ? "model: " + state.model : "";
}

$("model-picker").addEventListener("change", () => {
  state.model = $("model-picker").value;
  showModel();
});

async function checkKey() {
  try {
    const models = await (await api("/v1/models")).json();
    fillModelPicker(models.data);
    state.ui = await (await api("/ui/config")).json();
    updateAttach();
    $("key-dialog").hidden = true;
    return true;
  } catch (error) {
    if (!(error instanceof AuthError)) $("status").textContent = "Server not reachable: " + error.message;
    return false;
  }
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
  if (await checkKey()) {
    $("key-input").value = "";
    if (!$("view-engine").hidden) startEngineView();
  }
});

// ---- Markdown: escape everything first, then add only the tags we make ourselves

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

function renderInline(text) {  // text is escaped already
  return text.split(/(`[^`\n]+`)/).map((part, i) => {
    if (i % 2 === 1) return "<code>" + part.slice(1, -1) + "</code>";
    return part
      .replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)([^_]*?\S)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=\S)([^_\n]*?\S)_(?!\w)/g, "$1<em>$2</em>");
  }).join("");
}

function renderBlocks(text) {  // escaped text without code fences
  const html = [];
  let list = null;  // { tag, items }
  let paragraph = [];
  const flushParagraph = () => {
    if (paragraph.length) html.push("<p>" + paragraph.map(renderInline).join("<br>") + "</p>");
    paragraph = [];
  };
  const flushList = () => {
    if (list) html.push(`<${list.tag}>` + list.items.map((i) => "<li>" + renderInline(i) + "</li>").join("") + `</${list.tag}>`);
    list = null;
  };
  for (const line of text.split("\n")) {
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (bullet || numbered) {
      flushParagraph();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      list = list || { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
    } else if (heading) {
      flushParagraph(); flushList();
      const level = Math.min(heading[1].length + 2, 6);  // h3..h6 inside a message
      html.push(`<h${level}>` + renderInline(heading[2]) + `</h${level}>`);
    } else if (!line.trim()) {
      flushParagraph(); flushList();
    } else {
      flushList();
      paragraph.push(line);
    }
  }
  flushParagraph(); flushList();
  return html.join("");
}

function renderMarkdown(source) {
  // Odd parts sit between ``` fences; an unclosed fence (still streaming) is code too.
  return escapeHtml(source).split("```").map((part, i) => {
    if (i % 2 === 0) return renderBlocks(part);
    const newline = part.indexOf("\n");
    const lang = newline >= 0 ? part.slice(0, newline).trim() : "";
    const code = newline >= 0 ? part.slice(newline + 1) : part;
    const attr = /^[\w+#-]+$/.test(lang) ? ` data-lang="${lang}"` : "";
    return `<pre><code${attr}>${code}</code></pre>`;
  }).join("");
}

function renderHeatMap(tokens) {  // tokens: [{ text, logprob }]
  return tokens.map(({ text, logprob }) => {
    const p = logprob == null ? 1 : Math.exp(logprob);
    const bucket = Math.min(9, Math.floor(p * 10));
    const tip = `${escapeHtml(JSON.stringify(text))} p=${p.toFixed(3)} logprob=${(logprob ?? 0).toFixed(3)}`;
    return `<span class="tok lp${bucket}" title="${tip}">${escapeHtml(text)}</span>`;
  }).join("");
}

// ---- Playground

const state = {
  model: undefined,
  history: [],        // chat: [{ role, content }] sent as `messages` (system prompt excluded)
  lastRequest: null,  // { mode, prompt } of the last turn, for Regenerate
  controller: null,   // AbortController of the stream in flight
  messages: [],       // rendered assistant messages (for the heat-map toggle)
  ui: { images: false, max_images: 0 },  // /ui/config: what this server's model takes
  pending: [],        // data: URLs of the images the next chat message sends
};

function numberField(id, parse = parseFloat) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = parse(raw, 10);
  return Number.isFinite(value) ? value : undefined;
}

function samplingBody() {
  const body = {
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    top_k: numberField("top_k", parseInt),
    max_tokens: numberField("max_tokens", parseInt),
    seed: numberField("seed", parseInt),
    n: numberField("n", parseInt),
  };
  if (body.top_k === 0) body.top_k = undefined;
  return body;
}

function addUserMessage(text, images = []) {
  const node = document.createElement("div");
  node.className = "msg user";
  node.innerHTML = '<div class="role">You</div>';
  images.forEach((url, i) => node.append(imageNode(url, `image ${i + 1} sent`)));
  node.append(document.createTextNode(text));
  $("transcript").append(node);
  return node;
}

function addAssistantMessage(mode) {
  const node = document.createElement("div");
  node.className = "msg assistant";
  node.innerHTML = `<div class="role">${mode === "chat" ? "Assistant" : "Completion"}</div><div class="choices"></div><div class="meta"></div>`;
  $("transcript").append(node);
  const message = { node, choices: [], done: false };
  state.messages.push(message);
  return message;
}

function choiceOf(message, index) {
  while (message.choices.length <= index) {
    const node = document.createElement("div");
    node.className = "choice";
    node.innerHTML = '<div class="content"></div>';
    message.node.querySelector(".choices").append(node);
    message.choices.push({ node, text: "", tokens: [], finish: null });
  }
  return message.choices[index];
}

function renderChoice(message, choice) {
  const content = choice.node.querySelector(".content");
  const heat = $("logprobs").checked && choice.tokens.length;
  content.classList.toggle("raw", Boolean(heat));
  content.innerHTML = heat ? renderHeatMap(choice.tokens) : renderMarkdown(choice.text);
  if (message.choices.length > 1 && choice.finish) {
    content.insertAdjacentHTML("beforeend", `<div class="meta">choice ${message.choices.indexOf(choice) + 1}: ${escapeHtml(choice.finish)}</div>`);
  }
}

function applyChunk(message, chunk, mode) {
  for (const c of chunk.choices || []) {
    const choice = choiceOf(message, c.index);
    if (mode === "chat") {
      choice.text += (c.delta && c.delta.content) || "";
      for (const t of (c.logprobs && c.logprobs.content) || []) choice.tokens.push({ text: t.token, logprob: t.logprob });
    } else {
      choice.text += c.text || "";
      const lp = c.logprobs;
      if (lp) lp.tokens.forEach((text, i) => choice.tokens.push({ text, logprob: lp.token_logprobs[i] }));
    }
    if (c.finish_reason) choice.finish = c.finish_reason;
    renderChoice(message, choice);
  }
}

function messageMeta(timing, usage, outcome) {
  const parts = [];
  if (timing.first) parts.push(`TTFT ${(timing.first - timing.start).toFixed(0)} ms`);
  if (usage) {
    const seconds = ((timing.end || performance.now()) - (timing.first || timing.start)) / 1000;
    if (seconds > 0 && usage.completion_tokens > 1) parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tokens/s`);
    parts.push(`${usage.completion_tokens} tokens`);
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (outcome) parts.push(outcome);
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !state.lastRequest;
}

async function generate(mode, prompt) {
  const body = { model: state.model, stream: true, stream_options: { include_usage: true }, ...samplingBody() };
  const heat = $("logprobs").checked;
  let path;
  if (mode === "chat") {
    const system = $("system").value.trim();
    body.messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
    if (heat) body.logprobs = true;
    path = "/v1/chat/completions";
  } else {
    body.prompt = prompt;
    if (heat) body.logprobs = 1;
    path = "/v1/completions";
  }
  const message = addAssistantMessage(mode);
  const timing = { start: performance.now(), first: 0, end: 0 };
  let usage = null;
  let outcome = "";
  state.controller = new AbortController();
  setBusy(true);
  $("status").textContent = "Generating…";
  try {
    const response = await api(path, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: state.controller.signal,
    });
    await readSSE(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (!timing.first && (chunk.choices || []).length) timing.first = performance.now();
      if (chunk.usage) usage = chunk.usage;
      applyChunk(message, chunk, mode);
      message.node.querySelector(".meta").textContent = messageMeta(timing, usage, "");
      $("transcript").scrollTop = $("transcript").scrollHeight;
    });
  } catch (error) {
    outcome = error.name === "AbortError" ? "stopped" : "error: " + error.message;
  }
  timing.end = performance.now();
  message.done = true;
  message.node.dataset.state = outcome === "stopped" ? "stopped" : outcome ? "error" : "done";
  message.node.querySelector(".meta").textContent = messageMeta(timing, usage, outcome);
  if (mode === "chat" && message.choices.length) state.history.push({ role: "assistant", content: message.choices[0].text });
  state.controller = null;
  $("status").textContent = outcome || "Done.";
  setBusy(false);
}

async function send(text) {
  const mode = $("mode").value;
  const images = mode === "chat" ? state.pending.splice(0) : [];
  renderAttachments();
  addUserMessage(text, images);
  if (mode === "chat") state.history.push({ role: "user", content: images.length ? withImages(text, images) : text });
  state.lastRequest = { mode, prompt: text };
  await generate(mode, text);
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if ((!text.trim() && !state.pending.length) || state.controller) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => state.controller && state.controller.abort());

$("regenerate").addEventListener("click", () => {
  const last = state.lastRequest;
  if (!last || state.controller) return;
  const transcript = $("transcript");
  if (transcript.lastElementChild && transcript.lastElementChild.classList.contains("assistant")) {
    transcript.lastElementChild.remove();
    state.messages.pop();
    if (last.mode === "chat" && state.history.length && state.history.at(-1).role === "assistant") state.history.pop();
  }
  generate(last.mode, last.prompt);
});

$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  $("transcript").replaceChildren();
  Object.assign(state, { history: [], lastRequest: null, messages: [], pending: [] });
  renderAttachments();
  setBusy(false);
  $("status").textContent = "";
});

$("mode").addEventListener("change", () => {
  const chat = $("mode").value === "chat";
  $("system").disabled = !chat;
  $("prompt").placeholder = chat ? "Message (Enter to send, Shift+Enter for a new line)" : "Raw prompt, sent as is (Enter to send)";
  updateAttach();
});

// ---- Images: a model that reads them (/ui/config) takes them in chat mode, from the file
// input, a drop on the composer or a paste, each sent as an image_url part (a data: URL).

const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp"];  // what the server decodes

function imageNode(url, alt) {
  const img = document.createElement("img");
  img.src = url;  // a data: URL (the page's CSP allows those images only)
  img.alt = alt;
  return img;
}

function withImages(text, images) {  // the chat message's content parts
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return text.trim() ? parts.concat([{ type: "text", text }]) : parts;
}

function updateAttach() {
  const on = state.ui.images && $("mode").value === "chat";
  $("attach").hidden = !on;
  if (!on) state.pending = [];
  renderAttachments();
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(...state.pending.map((url, i) => {
    const figure = document.createElement("figure");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove image ${i + 1}`);
    remove.addEventListener("click", () => { state.pending.splice(i, 1); renderAttachments(); });
    figure.append(imageNode(url, `image ${i + 1} to send`), remove);
    return figure;
  }));
  box.hidden = !state.pending.length;
}

function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function addImages(files) {
  if ($("attach").hidden) return;
  for (const file of files) {
    if (!IMAGE_TYPES.includes(file.type)) {
      $("status").textContent = `${file.name || "The file"} is not a PNG, JPEG or WebP image.`;
    } else if (state.pending.length >= state.ui.max_images) {
      $("status").textContent = `At most ${state.ui.max_images} images per message.`;
    } else {
      state.pending.push(await readDataURL(file));
    }
  }
  renderAttachments();
}

$("image-input").addEventListener("change", async (event) => {
  await addImages([...event.target.files]);
  event.target.value = "";  // the same file may be chosen again
});

$("prompt").addEventListener("paste", (event) => {
  const files = [...((event.clipboardData && event.clipboardData.files) || [])].filter((f) => f.type.startsWith("image/"));
  if (files.length && !$("attach").hidden) {
    event.preventDefault();
    addImages(files);
  }
});

$("composer").addEventListener("dragover", (event) => {
  if ($("attach").hidden || !event.dataTransfer.types.includes("Files")) return;
  event.preventDefault();
  $("composer").classList.add("dropping");
});
$("composer").addEventListener("dragleave", () => $("composer").classList.remove("dropping"));
$("composer").addEventListener("drop", (event) => {
  $("composer").classList.remove("dropping");
  if ($("attach").hidden) return;
  event.preventDefault();
  addImages([...event.dataTransfer.files]);
});

$("logprobs").addEventListener("change", () => {
  for (const message of state.messages) for (const choice of message.choices) renderChoice(message, choice);
});

// ---- Engine view: /ui/stats over fetch while the Engine tab is shown

const engine = { controller: null, cards: new Map(), retry: null };

function startEngineView() {
  if (engine.controller) return;
  const controller = new AbortController();
  engine.controller = controller;
  (async () => {
    try {
      const response = await api("/ui/stats", { signal: controller.signal });
      $("engine-status").textContent = "Live (2 updates/s).";
      await readSSE(response, renderEngines);
      $("engine-status").textContent = "The stats stream ended.";
    } catch (error) {
      if (error.name === "AbortError") return;
      $("engine-status").textContent = "Disconnected: " + error.message;
    } finally {
      if (engine.controller === controller) engine.controller = null;
    }
    if (!(controller.signal.aborted) && $("key-dialog").hidden && !$("view-engine").hidden) {
      engine.retry = setTimeout(startEngineView, 2000);
    }
  })();
}

function stopEngineView() {
  clearTimeout(engine.retry);
  if (engine.controller) engine.controller.abort();
  engine.controller = null;
}

function renderEngines(snapshot) {
  if (!snapshot.engines.length) $("engine-status").textContent = "Waiting for the engine's first stats…";
  for (const stats of snapshot.engines) {
    let card = engine.cards.get(stats.engine);
    if (!card) {
      card = $("engine-template").content.firstElementChild.cloneNode(true);
      card.querySelector(".engine-title").textContent = `Engine ${stats.engine}`;
      card.setAttribute("aria-label", `Engine ${stats.engine}`);
      card.dataset.engine = stats.engine;
      $("engines").append(card);
      engine.cards.set(stats.engine, card);
    }
    renderEngine(card, stats);
  }
}

const percent = (x) => (x == null ? "–" : (100 * x).toFixed(1) + " %");

function renderEngine(card, s) {
  const set = (cls, text) => { card.querySelector(cls).textContent = text; };
  set(".running", String(s.num_running));
  set(".waiting", String(s.num_waiting));
  set(".kv-usage", percent(s.kv_cache_usage));
  set(".hit-rate", percent(s.prefix_cache_hit_rate));
  set(".preemptions", String(s.num_preemptions));
  if (s.block_map) renderBlockMap(card, s.block_map);
  renderTimeline(card, s.steps);
  renderRoofline(card, s.roofline);
}

function renderBlockMap(card, map) {
  const grid = card.querySelector(".block-map");
  const n = map.used.length;
  if (grid.children.length !== n) {
    grid.replaceChildren(...Array.from({ length: n }, () => Object.assign(document.createElement("div"), { className: "block" })));
  }
  let used = 0, cached = 0;
  map.used.forEach((u, i) => {
    const c = Math.min(map.cached[i], 100 - u);
    used += u; cached += c;
    // CSSOM, not a style attribute: the page's CSP forbids inline styles.
    grid.children[i].style.background = `linear-gradient(to top, var(--used) ${u}%, var(--cached) ${u}% ${u + c}%, var(--free) ${u + c}%)`;
  });
  const per = Math.max(1, Math.round(map.num_blocks / n));
  card.querySelector(".block-count").textContent = `${map.num_blocks} blocks${per > 1 ? `, ${per} per cell` : ""}`;
  grid.setAttribute("aria-label", `KV blocks: ${(used / n).toFixed(1)} % used, ${(cached / n).toFixed(1)} % cached, ${(100 - (used + cached) / n).toFixed(1)} % free`);
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svgNode(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function renderTimeline(card, steps) {  // steps: [[prefill, decode, ms, preemptions]]
  const W = 600, H = 160, top = 14, bottom = H - 4, cap = 120;
  const svg = svgNode("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", "aria-hidden": "true" });
  const maxTokens = Math.max(1, ...steps.map((s) => s[0] + s[1]));
  const maxMs = Math.max(0.001, ...steps.map((s) => s[2]));
  const slot = W / cap, x0 = W - steps.length * slot, scale = (bottom - top) / maxTokens;
  const points = [];
  steps.forEach(([prefill, decode, ms, preempted], i) => {
    const x = x0 + i * slot;
    const hd = decode * scale, hp = prefill * scale;
    svg.append(svgNode("rect", { class: "decode", x, y: bottom - hd, width: slot * 0.8, height: hd }));
    svg.append(svgNode("rect", { class: "prefill", x, y: bottom - hd - hp, width: slot * 0.8, height: hp }));
    if (preempted) svg.append(svgNode("circle", { class: "preempt", cx: x + slot * 0.4, cy: top - 6, r: 3 }));
    points.push(`${(x + slot * 0.4).toFixed(1)},${(bottom - (ms / maxMs) * (bottom - top)).toFixed(1)}`);
  });
  if (points.length > 1) svg.append(svgNode("polyline", { class: "time", points: points.join(" ") }));
  const label = svgNode("text", { x: 4, y: 10 });
  label.textContent = `max ${maxTokens} tokens · ${maxMs.toFixed(1)} ms`;
  svg.append(label);
  card.querySelector(".timeline").replaceChildren(svg);
  const last = steps.at(-1);
  const summary = last
    ? `${steps.length} steps shown; last: ${last[0]} prefill + ${last[1]} decode tokens in ${last[2].toFixed(2)} ms`
    : "No steps yet.";
  card.querySelector(".timeline-summary").textContent = summary;
  card.querySelector(".timeline").setAttribute("aria-label", "Step timeline. " + summary);
}

function renderRoofline(card, report) {
  const rows = Object.entries(report).map(([phase, r]) => {
    const cell = (pct) => (pct == null ? "<td>unknown</td>" : `<td><meter min="0" max="100" value="${Math.min(100, pct)}" aria-label="${phase} ${pct} %"></meter>${pct.toFixed(2)} %</td>`);
    return `<tr><th scope="row">${escapeHtml(phase)}</th>${cell(r.pct_compute_roofline)}${cell(r.pct_bandwidth_roofline)}<td>${r.steps}</td></tr>`;
  });
  card.querySelector(".roofline tbody").innerHTML = rows.join("") || '<tr><td colspan="4">No steps in the last 10 s.</td></tr>';
}

// ---- Tabs (arrow keys move between them, as the ARIA tabs pattern asks)

const TABS = ["playground", "engine"];

function selectTab(name, focus = false) {
  for (const tab of TABS) {
    const selected = tab === name;
    $("tab-" + tab).setAttribute("aria-selected", String(selected));
    $("tab-" + tab).tabIndex = selected ? 0 : -1;
    $("view-" + tab).hidden = !selected;
  }
  if (focus) $("tab-" + name).focus();
  if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
  if (name === "engine") startEngineView(); else stopEngineView();
}

for (const tab of TABS) {
  $("tab-" + tab).addEventListener("click", () => selectTab(tab));
  $("tab-" + tab).addEventListener("keydown", (event) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (step) selectTab(TABS[(TABS.indexOf(tab) + step + TABS.length) % TABS.length], true);
    if (event.key === "Home") selectTab(TABS[0], true);
    if (event.key === "End") selectTab(TABS.at(-1), true);
  });
}

(async () => {
  const ok = await checkKey();  // shows the key dialog on a 401
  selectTab(location.hash === "#engine" ? "engine" : "playground");
  setBusy(false);
  if (ok) $("prompt").focus();
})();
