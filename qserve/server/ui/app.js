// qserve playground: chat with a served model (streamed over SSE) and watch the shared KV
// page pool. Plain browser JavaScript, no dependencies, nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 500;
let history = []; // chat messages sent so far: {role, content}
let controller = null; // AbortController of the running request

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
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
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

function requestBody(prompt) {
  const body = {
    model: $("model").value,
    stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top_p").value),
    max_tokens: parseInt($("max_tokens").value, 10),
  };
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  if ($("endpoint").value === "chat") {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
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
  addMessage("user", prompt);
  const reply = addMessage("assistant", "");
  const text = reply.querySelector(".text");
  const started = performance.now();
  let tokens = 0;
  let finish = null;
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating…");
  try {
    const url = chat ? "/v1/chat/completions" : "/v1/completions";
    const response = await fetch(url, {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(prompt)), signal: controller.signal,
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
        text.textContent += piece;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      $("log").scrollTop = $("log").scrollHeight;
    });
    if (chat) history.push({ role: "user", content: prompt }, { role: "assistant", content: text.textContent });
    const seconds = (performance.now() - started) / 1000;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = `${tokens} tokens in ${seconds.toFixed(2)} s · finish: ${finish}`;
    reply.appendChild(meta);
    setStatus("");
  } catch (err) {
    if (err.name === "AbortError") {
      setStatus("stopped");
    } else {
      reply.className = "msg error";
      text.textContent += (text.textContent ? "\n" : "") + "error: " + err.message;
      setStatus("");
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
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
$("clear").addEventListener("click", () => { history = []; $("log").innerHTML = ""; });
$("api_key").addEventListener("change", loadModels);

loadModels();
poll();
