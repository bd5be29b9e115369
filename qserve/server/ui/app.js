// qserve playground: chat with a served model (streamed over SSE) and watch the shared KV
// page pool. Plain browser JavaScript, no dependencies, nothing loaded from elsewhere.
// Conversations are kept in localStorage (list, new, delete); answers render as Markdown
// (markdown.js, HTML-escaped); the last answer can be regenerated and the last question edited.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 500;
const STORE_KEY = "qserve.conversations";
let controller = null; // AbortController of the running request
let conversations = loadConversations(); // [{id, title, updated, messages: [{role, content, stats}]}]
let current = null; // the open conversation

function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE_KEY) || "[]");
    return Array.isArray(list) ? list : [];
  } catch (err) {
    return [];
  }
}

function saveConversations() {
  try { localStorage.setItem(STORE_KEY, JSON.stringify(conversations)); } catch (err) { /* full or disabled */ }
  renderConversationList();
}

function newConversation() {
  current = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "new chat", updated: Date.now(), messages: [] };
  renderLog();
  renderConversationList();
}

function openConversation(id) {
  const found = conversations.find((c) => c.id === id);
  if (found) { current = found; renderLog(); renderConversationList(); }
}

function storeCurrent() {
  if (!current.messages.length) return;
  const first = current.messages.find((m) => m.role === "user");
  current.title = first ? first.content.slice(0, 40) : current.title;
  current.updated = Date.now();
  if (!conversations.includes(current)) conversations.unshift(current);
  saveConversations();
}

function renderConversationList() {
  const select = $("conversations");
  select.replaceChildren();
  const entries = conversations.includes(current) ? conversations : [current, ...conversations];
  for (const c of entries) {
    const option = document.createElement("option");
    option.value = c.id;
    option.textContent = c.title || "new chat";
    select.appendChild(option);
  }
  select.value = current.id;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (err) { // no clipboard API (insecure origin): the old way
    const area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "copied";
  setTimeout(() => { button.textContent = "copy"; }, 1200);
}

function copyButton(getText) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = "copy";
  button.addEventListener("click", () => copyText(getText(), button));
  return button;
}

function renderText(el, role, text) {
  if (role === "assistant") {
    QMarkdown.render(el, text, (pre, code) => pre.appendChild(copyButton(() => code)));
  } else {
    el.textContent = text;
  }
}

function statsLine(stats) {
  const parts = [`${stats.tokens} tokens`, `${stats.tps.toFixed(1)} tok/s`];
  if (stats.ttft_ms !== null) parts.push(`TTFT ${stats.ttft_ms.toFixed(0)} ms`);
  parts.push(`${stats.seconds.toFixed(2)} s`, `finish: ${stats.finish}`);
  return parts.join(" · ");
}

function renderLog() {
  $("log").replaceChildren();
  current.messages.forEach((m) => {
    const div = addMessage(m.role, m.content);
    if (m.stats) addStats(div, m.stats);
  });
  updateActions();
}

function addStats(div, stats) {
  const meta = document.createElement("span");
  meta.className = "meta stats";
  meta.textContent = statsLine(stats);
  div.appendChild(meta);
}

function updateActions() {
  const msgs = current.messages;
  const last = msgs[msgs.length - 1];
  $("regenerate").disabled = Boolean(controller) || !last || last.role !== "assistant";
  $("edit").disabled = Boolean(controller) || !msgs.some((m) => m.role === "user");
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text) { $("status").textContent = text; }

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.dataset.role = role;
  const body = document.createElement("div");
  body.className = "text";
  renderText(body, role, text);
  div.appendChild(body);
  div.appendChild(copyButton(() => div.dataset.raw || body.textContent));
  div.dataset.raw = text;
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    const select = $("model");
    const current = select.value;
    select.innerHTML = "";
    for (const m of body.data) {
      const option = document.createElement("option");
      option.value = option.textContent = m.id;
      select.appendChild(option);
    }
    if (current) select.value = current;
    setStatus("");
  } catch (err) {
    setStatus("models: " + err.message + " (retrying)");
    setTimeout(loadModels, 1000);
  }
}

const NUMBER_FIELDS = [ // [input id, request field, parse]; left empty: the server's default
  ["top_k", "top_k", parseInt], ["min_p", "min_p", parseFloat], ["repetition_penalty", "repetition_penalty", parseFloat],
  ["presence_penalty", "presence_penalty", parseFloat], ["frequency_penalty", "frequency_penalty", parseFloat],
  ["seed", "seed", parseInt],
];

function requestBody(prompt, earlier) {
  const body = {
    model: $("model").value,
    stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top_p").value),
    max_tokens: parseInt($("max_tokens").value, 10),
  };
  for (const [id, field, parse] of NUMBER_FIELDS) {
    const value = $(id).value.trim();
    if (value !== "") body[field] = parse(value, 10);
  }
  const stop = $("stop_seqs").value.split("|").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  if ($("endpoint").value === "chat") {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    const history = earlier.map((m) => ({ role: m.role, content: m.content }));
    body.messages = messages.concat(history, [{ role: "user", content: prompt }]);
  } else {
    body.prompt = prompt;
  }
  return body;
}

// Reads an SSE body; calls onEvent(parsedJson) per "data:" line until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(prompt) {
  const chat = $("endpoint").value === "chat";
  const earlier = current.messages.slice();
  current.messages.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const reply = addMessage("assistant", "");
  const text = reply.querySelector(".text");
  const started = performance.now();
  let ttft = null;
  let answer = "";
  let tokens = 0;
  let chunks = 0;
  let finish = null;
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  updateActions();
  setStatus("generating…");
  try {
    const url = chat ? "/v1/chat/completions" : "/v1/completions";
    const response = await fetch(url, {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(prompt, earlier)), signal: controller.signal,
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : response.statusText);
    }
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) tokens = event.usage.completion_tokens;
      for (const choice of event.choices || []) {
        const piece = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
        if (piece && ttft === null) ttft = performance.now() - started;
        if (piece) chunks += 1;
        answer += piece;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      renderText(text, "assistant", answer);
      reply.dataset.raw = answer;
      $("log").scrollTop = $("log").scrollHeight;
    });
    const seconds = (performance.now() - started) / 1000;
    tokens = tokens || chunks;
    const decodeSeconds = ttft === null ? seconds : seconds - ttft / 1000;
    const stats = { tokens, seconds, ttft_ms: ttft, tps: decodeSeconds > 0 ? tokens / decodeSeconds : 0, finish };
    addStats(reply, stats);
    current.messages.push({ role: "assistant", content: answer, stats });
    storeCurrent();
    setStatus("");
  } catch (err) {
    current.messages.pop(); // the question goes back to the box rather than staying unanswered
    if (err.name === "AbortError") {
      $("prompt").value = prompt;
      renderLog();
      setStatus("stopped");
    } else {
      reply.className = "msg error";
      text.textContent = answer + (answer ? "\n" : "") + "error: " + err.message;
      setStatus("");
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    updateActions();
  }
}

// Regenerate: drop the last answer and ask its question again.
function regenerate() {
  const msgs = current.messages;
  if (controller || !msgs.length || msgs[msgs.length - 1].role !== "assistant") return;
  msgs.pop();
  const question = msgs.pop();
  renderLog();
  send(question.content);
}

// Edit: the last question (and its answer) come off the conversation and back into the box.
function editLast() {
  const msgs = current.messages;
  if (controller) return;
  let i = msgs.length - 1;
  while (i >= 0 && msgs[i].role !== "user") i -= 1;
  if (i < 0) return;
  $("prompt").value = msgs[i].content;
  msgs.splice(i);
  storeCurrent();
  renderLog();
  $("prompt").focus();
}

function renderPool(stats) {
  const pool = $("pool");
  pool.innerHTML = "";
  let total = 0, free = 0;
  for (const m of stats.models) {
    total = m.pages_total;
    free = m.pages_free;
    const card = document.createElement("div");
    card.className = "model-card";
    card.dataset.model = m.name;
    const share = m.pages_total ? (100 * m.pages_used) / m.pages_total : 0;
    card.innerHTML = `<h3></h3><div class="bar"><div></div></div>
      <div class="numbers">
        <span>pages held</span><span class="pages-used">${m.pages_used} / ${m.pages_total}</span>
        <span>running</span><span class="running">${m.running}</span>
        <span>waiting</span><span class="waiting">${m.waiting}</span>
        <span>tok/s</span><span class="tps">${m.tokens_per_s.toFixed(1)}</span>
        <span>tokens generated</span><span class="generated">${m.generated_tokens}</span>
      </div>`;
    card.querySelector("h3").textContent = m.name;
    // Set through the DOM, not a style attribute: the page's Content-Security-Policy forbids inline styles.
    card.querySelector(".bar > div").style.width = `${share.toFixed(1)}%`;
    pool.appendChild(card);
  }
  $("pool-summary").textContent = stats.models.length
    ? `${total - free} of ${total} pages in use, ${free} free`
    : stats.ready ? "no models" : "loading models…";
}

async function poll() {
  try {
    const r = await fetch("/ui/stats", { cache: "no-store", headers: headers() });
    if (r.ok) renderPool(await r.json());
  } catch (err) {
    $("pool-summary").textContent = "server unreachable";
  }
  setTimeout(poll, POLL_MS);
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || controller) return;
  $("prompt").value = "";
  send(prompt);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { if (!controller) newConversation(); });
$("new_chat").addEventListener("click", () => { if (!controller) newConversation(); });
$("delete_chat").addEventListener("click", () => {
  if (controller) return;
  conversations = conversations.filter((c) => c.id !== current.id);
  saveConversations();
  if (conversations.length) openConversation(conversations[0].id); else newConversation();
});
$("conversations").addEventListener("change", (e) => { if (!controller) openConversation(e.target.value); });
$("regenerate").addEventListener("click", regenerate);
$("edit").addEventListener("click", editLast);
$("api_key").addEventListener("change", loadModels);

if (conversations.length) openConversation(conversations[0].id); else newConversation();
loadModels();
poll();
