// qwen3-serve's chat page and engine view (server/page.py). Plain JavaScript: no build step, no library.
//
// The chat streams /v1/chat/completions (server-sent events read from fetch's ReadableStream), keeps the
// conversation here and sends it whole each turn. The engine view polls /engine/state.
// Everything the model or the server wrote is inserted with textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "qwen3-scratch-api-key"; // sessionStorage: the key lives as long as the tab
const MAX_TOOL_ROUNDS = 4; // model -> tool -> model ... at most this many model replies per question
const POLL_MS = 500;

// The calculator the tiny model was trained to call (scripts/calculator.json).
const CALCULATOR = {
  type: "function",
  function: {
    name: "calculator",
    description: "Evaluate an arithmetic expression of integers with +, - and *.",
    parameters: {
      type: "object",
      properties: { expression: { type: "string", description: "for example 4821 * 37" } },
      required: ["expression"],
    },
  },
};

// ---- the API key: asked for when the server answers 401 ------------------------------------------

let keyWaiters = null; // callers waiting for the person to type a key (one dialog for them all)

function askForKey(problem) {
  if (keyWaiters === null) {
    keyWaiters = [];
    $("key-error").textContent = problem;
    $("key-dialog").showModal();
    $("key-input").focus();
  }
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function useKey() {
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  $("key-input").value = "";
  $("key-dialog").close();
  const waiters = keyWaiters || [];
  keyWaiters = null;
  waiters.forEach((resolve) => resolve());
}

// fetch, with the key if there is one; a 401 asks for a key and tries again.
async function api(path, options = {}) {
  for (;;) {
    const key = sessionStorage.getItem(KEY);
    const headers = { ...(options.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const message = await errorMessage(response);
    await askForKey(key ? `The server refused the key: ${message}` : "");
  }
}

// The server's own words: OpenAI's {"error": {"message"}} body, else the status line.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: fall through */ }
  return `${response.status} ${response.statusText}${text ? `: ${text.slice(0, 300)}` : ""}`;
}

// ---- server-sent events ---------------------------------------------------------------------------

// Each `data:` line's JSON, until `data: [DONE]` or the end of the body.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop(); // an unfinished line waits for the next read
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// ---- the calculator ----------------------------------------------------------------------------------

// Integers, + - * and parentheses, computed exactly (BigInt): scripts/tiny_tasks.py's calculate().
// A small recursive-descent parser; the model's text is never evaluated as code.
function calculate(expression) {
  if (typeof expression !== "string") throw new Error("the expression must be a string");
  if (expression.length > 200) throw new Error("expression longer than 200 characters");
  const tokens = expression.match(/\d+|\w+|\S/g) || []; // a word whole, so an error can name it
  let at = 0;
  const unexpected = () =>
    new Error(at < tokens.length ? `unexpected ${JSON.stringify(tokens[at])}` : "the expression ends too early");
  const atom = () => {
    const token = tokens[at];
    if (token === "(") {
      at += 1;
      const value = sum();
      if (tokens[at] !== ")") throw unexpected();
      at += 1;
      return value;
    }
    if (token === "-") {
      at += 1;
      return -atom();
    }
    if (token !== undefined && /^\d+$/.test(token)) {
      at += 1;
      return BigInt(token);
    }
    throw unexpected();
  };
  const product = () => {
    let value = atom();
    while (tokens[at] === "*") {
      at += 1;
      value *= atom();
    }
    return value;
  };
  const sum = () => {
    let value = product();
    while (tokens[at] === "+" || tokens[at] === "-") {
      const op = tokens[at];
      at += 1;
      value = op === "+" ? value + product() : value - product();
    }
    return value;
  };
  const value = sum();
  if (at !== tokens.length) throw unexpected();
  return value.toString();
}

// A tool call -> the text sent back as the tool's message.
function runTool(call) {
  if (call.name !== "calculator") return { ok: false, text: `error: there is no tool named ${call.name}` };
  try {
    const args = JSON.parse(call.arguments || "{}");
    return { ok: true, text: calculate(args.expression) };
  } catch (error) {
    return { ok: false, text: `error: ${error.message}` };
  }
}

// ---- the conversation -------------------------------------------------------------------------------

const chat = { model: null, messages: [], controller: null };

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text; // text, never HTML
  return node;
}

function addBubble(role) {
  $("empty").hidden = true;
  const bubble = element("div", `message ${role}`);
  bubble.append(element("div", "role", role === "user" ? "You" : "Assistant"));
  $("messages").append(bubble);
  return bubble;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

// One assistant reply on the page: reasoning (folded once the answer starts), answer, tool calls, a footer.
class ReplyView {
  constructor() {
    this.bubble = addBubble("assistant");
    this.reasoning = element("details", "reasoning");
    this.reasoning.open = true;
    this.summary = element("summary", "", "Thinking…");
    this.thoughts = element("div", "thoughts");
    this.reasoning.append(this.summary, this.thoughts);
    this.reasoning.hidden = true;
    this.answer = element("div", "answer streaming");
    this.calls = element("div", "calls");
    this.footer = element("div", "footer");
    this.bubble.append(this.reasoning, this.answer, this.calls, this.footer);
    this.folded = false;
    this.shownCalls = 0;
  }

  update(reply) {
    if (reply.reasoning) {
      this.reasoning.hidden = false;
      this.thoughts.textContent = reply.reasoning;
    }
    this.answer.textContent = reply.content;
    if ((reply.content || reply.toolCalls.length) && reply.reasoning && !this.folded) {
      this.folded = true; // once only: a person who opens it again keeps it open
      this.reasoning.open = false;
      this.summary.textContent = "Reasoning";
    }
    for (; this.shownCalls < reply.toolCalls.length; this.shownCalls += 1) {
      this.calls.append(this.callCard(reply.toolCalls[this.shownCalls]));
    }
    scrollDown();
  }

  callCard(call) {
    const card = element("div", "call");
    const text = `${call.name}(${describe(call.arguments)})`;
    card.append(element("span", "call-tag", "tool call"), element("code", "call-text", text));
    call.resultNode = element("div", "call-result pending", "…");
    card.append(call.resultNode);
    return card;
  }

  showResult(call, result) {
    call.resultNode.className = `call-result ${result.ok ? "ok" : "failed"}`;
    call.resultNode.textContent = `→ ${result.text}`;
  }

  error(message) {
    this.bubble.classList.add("failed");
    this.bubble.append(element("div", "error-text", message));
  }

  finish(reply, seconds) {
    this.answer.classList.remove("streaming");
    if (reply.reasoning && !this.folded) this.summary.textContent = "Reasoning"; // it ended before any answer
    if (!reply.content && !reply.reasoning && !reply.toolCalls.length && !reply.stopped) this.answer.hidden = true;
    const parts = [];
    if (reply.stopped) parts.push("stopped");
    if (reply.finish === "length") parts.push("cut at max tokens");
    const used = reply.usage;
    if (used) {
      parts.push(`${used.completion_tokens} tokens`);
      if (seconds > 0) parts.push(`${(used.completion_tokens / seconds).toFixed(1)} tokens/s`);
      const cached = used.prompt_tokens_details ? used.prompt_tokens_details.cached_tokens : 0;
      parts.push(`prompt ${used.prompt_tokens} (${cached} cached)`);
    }
    this.footer.textContent = parts.join(" · ");
  }
}

// A call's JSON arguments as `name: value, ...` (the raw text when it does not parse).
function describe(argumentsText) {
  try {
    const args = JSON.parse(argumentsText);
    return Object.entries(args).map(([k, v]) => `${k}: ${JSON.stringify(v)}`).join(", ");
  } catch (_) {
    return argumentsText;
  }
}

function settings() {
  const temperature = parseFloat($("temperature").value);
  const maxTokens = parseInt($("max-tokens").value, 10);
  return {
    system: $("system").value.trim(),
    thinking: $("thinking").checked,
    calculator: $("calculator").checked,
    temperature: Number.isFinite(temperature) ? temperature : null,
    maxTokens: Number.isFinite(maxTokens) ? maxTokens : null,
  };
}

function requestBody(s) {
  const system = s.system ? [{ role: "system", content: s.system }] : [];
  const body = {
    model: chat.model,
    messages: [...system, ...chat.messages],
    stream: true,
    stream_options: { include_usage: true },
    chat_template_kwargs: { enable_thinking: s.thinking },
  };
  if (s.temperature !== null) body.temperature = s.temperature;
  if (s.maxTokens !== null) body.max_tokens = s.maxTokens;
  if (s.calculator) body.tools = [CALCULATOR];
  return body;
}

// The reply's pieces, from one stream delta. The server sends the reasoning under two names
// (reasoning_content and reasoning): the same text, taken once.
function applyDelta(reply, delta) {
  const reasoning = delta.reasoning_content ?? delta.reasoning;
  if (reasoning) reply.reasoning += reasoning;
  if (delta.content) reply.content += delta.content;
  for (const part of delta.tool_calls || []) {
    const call = (reply.toolCalls[part.index] ||= { id: "", name: "", arguments: "" });
    if (part.id) call.id = part.id;
    if (part.function && part.function.name) call.name = part.function.name;
    if (part.function && part.function.arguments) call.arguments += part.function.arguments;
  }
}

// One streamed model reply; returns what it said and how it ended.
async function streamReply() {
  const view = new ReplyView();
  const reply = { content: "", reasoning: "", toolCalls: [], finish: null, usage: null, view };
  const controller = (chat.controller = new AbortController());
  let first = null;
  try {
    if (!chat.model) await loadModel();
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(settings())),
      signal: controller.signal,
    });
    if (!response.ok) throw new ServerSaid(await errorMessage(response));
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new ServerSaid(event.error.message); // a fault after the stream began
      if (event.usage) reply.usage = event.usage;
      for (const choice of event.choices || []) {
        applyDelta(reply, choice.delta || {});
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
      if (first === null && (reply.content || reply.reasoning)) first = performance.now();
      view.update(reply);
    }
  } catch (error) {
    if (error.name === "AbortError") reply.stopped = true;
    else {
      reply.failed = true;
      view.error(error instanceof ServerSaid ? error.message : `The request failed: ${error.message}`);
    }
  } finally {
    if (chat.controller === controller) chat.controller = null;
  }
  view.update(reply);
  view.finish(reply, first === null ? 0 : (performance.now() - first) / 1000);
  return reply;
}

class ServerSaid extends Error {}

function assistantMessage(reply) {
  const message = { role: "assistant", content: reply.content || (reply.toolCalls.length ? null : "") };
  if (reply.reasoning) message.reasoning_content = reply.reasoning; // Qwen3's template reads it back
  if (reply.toolCalls.length) {
    message.tool_calls = reply.toolCalls.map((call) => ({
      id: call.id,
      type: "function",
      function: { name: call.name, arguments: call.arguments },
    }));
  }
  return message;
}

async function send() {
  const text = $("input").value;
  if (!text.trim() || chat.controller) return;
  $("input").value = "";
  fitInput();
  chat.messages.push({ role: "user", content: text });
  addBubble("user").append(element("div", "answer", text));
  scrollDown();
  setBusy(true);
  try {
    for (let round = 0; round < MAX_TOOL_ROUNDS; round += 1) {
      const reply = await streamReply();
      if (reply.failed) break;
      if (reply.content || reply.toolCalls.length) chat.messages.push(assistantMessage(reply));
      if (reply.stopped || !reply.toolCalls.length) break;
      for (const call of reply.toolCalls) {
        const result = runTool(call);
        reply.view.showResult(call, result);
        chat.messages.push({ role: "tool", tool_call_id: call.id, content: result.text });
      }
    }
  } finally {
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
  if (!busy) $("input").focus();
}

function stop() {
  if (chat.controller) chat.controller.abort(); // the server sees the connection close and frees the blocks
}

function newChat() {
  stop();
  chat.messages = [];
  for (const node of [...$("messages").querySelectorAll(".message")]) node.remove();
  $("empty").hidden = false;
  $("input").focus();
}

async function loadModel() {
  const response = await api("/v1/models");
  if (!response.ok) throw new ServerSaid(await errorMessage(response));
  const body = await response.json();
  chat.model = body.data[0].id;
  $("model").textContent = chat.model;
}

function fitInput() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
}

// ---- the engine view ---------------------------------------------------------------------------------

const STATES = { ".": "free", c: "cached", u: "used", s: "shared" };
const STATE_WORDS = { free: "free", cached: "cached prefix, free to reuse", used: "in use", shared: "shared" };
const view = { polling: false, cells: [] };

function showEngine(on) {
  $("engine").hidden = !on;
  $("toggle-engine").setAttribute("aria-pressed", String(on));
  document.body.classList.toggle("with-engine", on);
  if (on && !view.polling) poll();
}

async function poll() {
  view.polling = true;
  try {
    const response = await api("/engine/state");
    if (response.ok) renderEngine(await response.json());
    else $("engine-status").textContent = await errorMessage(response);
  } catch (error) {
    $("engine-status").textContent = `cannot reach the server (${error.message})`;
  }
  if ($("engine").hidden) view.polling = false;
  else setTimeout(poll, POLL_MS);
}

function renderEngine(state) {
  const pool = state.pool;
  $("engine-status").textContent = "live";
  $("stat-running").textContent = state.running.length;
  $("stat-waiting").textContent = state.waiting.length;
  $("stat-rate").textContent = state.tokens_per_second.toFixed(1);
  $("stat-hit").textContent = `${Math.round(100 * state.prefix_cache_hit_rate)}%`;
  $("stat-preempt").textContent = state.preemptions;
  $("stat-blocks").textContent = `${pool.used + pool.shared} / ${pool.num_blocks}`;
  $("pool-size").textContent = `${pool.num_blocks} blocks of ${pool.block_size} tokens`;
  for (const name of ["free", "cached", "used", "shared"]) $(`count-${name}`).textContent = pool[name];
  renderRequests(state);
  renderGrid(pool, state);
}

function renderRequests(state) {
  const rows = [
    ...state.running.map((seq) => [seq, "running"]),
    ...state.waiting.map((seq) => [seq, "waiting"]),
  ].map(([seq, status]) => {
    const row = element("tr", status);
    const id = seq.index ? `${seq.id} #${seq.index}` : seq.id;
    const cells = [
      element("td", "id", shortId(id)),
      element("td", "", status),
      element("td", "", seq.cached_tokens ? `${seq.prompt_tokens} (${seq.cached_tokens} cached)` : seq.prompt_tokens),
      element("td", "", `${seq.output_tokens} / ${seq.max_tokens}`),
      element("td", "", seq.blocks.length),
    ];
    cells[0].title = id;
    row.append(...cells);
    row.addEventListener("mouseenter", () => highlight(seq.blocks, true));
    row.addEventListener("mouseleave", () => highlight(seq.blocks, false));
    return row;
  });
  $("requests").replaceChildren(...rows);
  $("no-requests").hidden = rows.length > 0;
}

function shortId(id) {
  return id.length > 14 ? `…${id.slice(-8)}` : id; // the whole id is the cell's title
}

function highlight(blocks, on) {
  for (const b of blocks) if (view.cells[b]) view.cells[b].classList.toggle("highlight", on);
}

function renderGrid(pool, state) {
  const grid = $("grid");
  if (view.cells.length !== pool.num_blocks) {
    view.cells = Array.from({ length: pool.num_blocks }, () => element("i", "cell"));
    grid.replaceChildren(...view.cells);
    grid.classList.toggle("dense", pool.num_blocks > 1024);
  }
  const owners = new Map(); // block id -> the requests whose tables list it
  for (const seq of [...state.running, ...state.waiting]) {
    for (const b of seq.blocks) owners.set(b, [...(owners.get(b) || []), shortId(seq.id)]);
  }
  for (let b = 0; b < pool.num_blocks; b += 1) {
    const name = STATES[pool.states[b]];
    const cell = view.cells[b];
    const highlighted = cell.classList.contains("highlight");
    cell.className = `cell ${name}${highlighted ? " highlight" : ""}`;
    const who = owners.get(b);
    cell.title = `block ${b}: ${STATE_WORDS[name]}${who ? ` (${who.join(", ")})` : ""}`;
  }
}

// ---- wiring -------------------------------------------------------------------------------------------

function start() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("input").addEventListener("input", fitInput);
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && chat.controller) stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("toggle-engine").addEventListener("click", () => showEngine($("engine").hidden));
  $("key-submit").addEventListener("click", useKey);
  $("key-input").addEventListener("keydown", (event) => {
    if (event.key !== "Enter") return;
    event.preventDefault(); // else the Enter lands, as a new line, in the message box the focus returns to
    useKey();
  });
  $("key-dialog").addEventListener("cancel", (event) => event.preventDefault()); // a key is needed to go on
  if (location.pathname === "/engine") {
    document.body.classList.add("engine-only");
    showEngine(true);
  }
  loadModel().catch((error) => {
    $("model").textContent = error.message;
  });
  $("input").focus();
}

start();
