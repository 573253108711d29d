// spindle's chat page: /v1/models for the picker, /v1/chat/completions streamed over SSE (fetch + ReadableStream),
// an AbortController behind the stop button (the server aborts the engine request when the connection closes).
// Every URL is relative, so the page works under --root-path. Model text reaches the DOM only through
// markdown.js, which escapes it before adding its own tags.
"use strict";
(() => {
  const KEY_STORE = "spindle.apiKey";
  const byId = (id) => document.getElementById(id);
  const el = {
    model: byId("model"), system: byId("system"), temperature: byId("temperature"), topP: byId("top-p"),
    maxTokens: byId("max-tokens"), key: byId("api-key"), messages: byId("messages"), error: byId("error"),
    form: byId("composer"), prompt: byId("prompt"), send: byId("send"), stop: byId("stop"), clear: byId("clear"),
    image: byId("image"), attachLabel: byId("attach-label"), attachment: byId("attachment"),
    preview: byId("attachment-preview"), removeImage: byId("attachment-remove"),
  };
  const chat = { history: [], controller: null, image: null };

  function showError(text) {
    el.error.textContent = text;
    el.error.hidden = !text;
  }

  function headers() {
    const h = { "content-type": "application/json" };
    const key = el.key.value.trim();
    if (key) h.authorization = `Bearer ${key}`;
    return h;
  }

  /** "401: <the server's message>" from an error response (OpenAI's shape, or whatever text came). */
  async function describeFailure(response) {
    const text = await response.text();
    let message = text;
    try { message = JSON.parse(text).error.message || text; } catch (_) { /* not the API's JSON: show it raw */ }
    return `${response.status}${response.statusText ? ` ${response.statusText}` : ""}: ${message}`;
  }

  async function loadModels() {
    try {
      const r = await fetch("v1/models", { headers: headers() });
      if (!r.ok) { showError(await describeFailure(r)); return; }
      const chosen = el.model.value;
      el.model.replaceChildren(...(await r.json()).data.map((m) => new Option(m.id, m.id)));
      if ([...el.model.options].some((o) => o.value === chosen)) el.model.value = chosen;
      showError("");
    } catch (e) {
      showError(`cannot reach the server: ${e.message}`);
    }
  }

  function bubble(role) {
    const div = document.createElement("div");
    div.className = `message ${role}`;
    div.dataset.testid = `message-${role}`;
    el.messages.append(div);
    return div;
  }

  function addUserMessage(text, image) {
    const div = bubble("user");
    div.textContent = text;
    if (image) {
      const img = document.createElement("img");
      img.src = image;
      img.alt = "attached image";
      div.append(img);
    }
    div.scrollIntoView({ block: "end" });
  }

  /** The assistant's bubble: raw text kept in data-raw, shown as rendered Markdown, one render per frame. */
  function assistantMessage() {
    const div = bubble("assistant");
    const body = document.createElement("div");
    body.className = "body";
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.dataset.testid = "reply-stats";
    div.append(body, stats);
    div.dataset.state = "streaming";
    let text = "";
    let pending = false;
    const paint = () => {
      pending = false;
      body.innerHTML = window.spindleMarkdown.render(text); // escaped first: markdown.js
      div.dataset.raw = text;
      div.scrollIntoView({ block: "end" });
    };
    return {
      append(delta) { text += delta; if (!pending) { pending = true; requestAnimationFrame(paint); } },
      text: () => text,
      finish(state, statsText) { paint(); div.dataset.state = state; stats.textContent = statsText; },
    };
  }

  function setStreaming(on) {
    el.send.disabled = on;
    el.stop.disabled = !on;
  }

  function number(input, parse) {
    const v = parse(input.value);
    return Number.isFinite(v) ? v : undefined;
  }

  function requestBody(messages) {
    const body = { model: el.model.value, messages, stream: true, stream_options: { include_usage: true } };
    const temperature = number(el.temperature, parseFloat);
    const topP = number(el.topP, parseFloat);
    const maxTokens = number(el.maxTokens, (v) => parseInt(v, 10));
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    return body;
  }

  /** Reads the SSE stream: calls onEvent with each JSON event; ends at [DONE] or the end of the body. */
  async function readEvents(response, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        buffer = buffer.slice(end + 2);
        if (data === "[DONE]") return;
        if (data) onEvent(JSON.parse(data));
      }
    }
  }

  function statsLine(reply) {
    const parts = [];
    if (reply.firstAt !== null) parts.push(`TTFT ${Math.round(reply.firstAt - reply.startAt)} ms`);
    const tokens = reply.usage ? reply.usage.completion_tokens : reply.chunks;
    parts.push(`${tokens} tokens`);
    const seconds = (performance.now() - (reply.firstAt ?? reply.startAt)) / 1000;
    if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
    if (reply.finish) parts.push(`finish: ${reply.finish}`);
    return parts.join(" · ");
  }

  async function stream(messages, reply, view) {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)), signal: chat.controller.signal,
    });
    if (!response.ok) throw new Error(await describeFailure(response));
    await readEvents(response, (event) => {
      if (event.error) throw new Error(`${event.error.code || "error"}: ${event.error.message}`);
      if (event.usage) reply.usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          if (reply.firstAt === null) reply.firstAt = performance.now();
          reply.chunks += 1;
          view.append(delta);
        }
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
    });
  }

  async function send() {
    const text = el.prompt.value;
    const image = chat.image;
    if ((!text.trim() && !image) || chat.controller) return;
    showError("");
    const content = image ? [{ type: "image_url", image_url: { url: image } }, { type: "text", text }] : text;
    const user = { role: "user", content };
    const system = el.system.value.trim() ? [{ role: "system", content: el.system.value }] : [];
    addUserMessage(text, image);
    el.prompt.value = "";
    setImage(null);
    const view = assistantMessage();
    const reply = { startAt: performance.now(), firstAt: null, chunks: 0, usage: null, finish: null };
    chat.controller = new AbortController();
    setStreaming(true);
    let state = "done";
    try {
      await stream([...system, ...chat.history, user], reply, view);
    } catch (e) {
      state = e.name === "AbortError" ? "stopped" : "error";
      if (state === "error") showError(e.message);
    } finally {
      chat.controller = null;
      setStreaming(false);
    }
    view.finish(state, state === "stopped" ? `${statsLine(reply)} · stopped` : statsLine(reply));
    if (state !== "error" && view.text()) chat.history.push(user, { role: "assistant", content: view.text() });
  }

  function setImage(dataUrl) {
    chat.image = dataUrl;
    el.attachment.hidden = !dataUrl;
    if (dataUrl) el.preview.src = dataUrl; else el.preview.removeAttribute("src");
    if (!dataUrl) el.image.value = "";
  }

  function readImage() {
    const file = el.image.files[0];
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => setImage(String(reader.result));
    reader.onerror = () => showError(`cannot read ${file.name}`);
    reader.readAsDataURL(file);
  }

  function wire() {
    el.key.value = localStorage.getItem(KEY_STORE) || "";
    el.key.addEventListener("change", () => {
      localStorage.setItem(KEY_STORE, el.key.value.trim());
      loadModels();
    });
    el.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
    el.prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    el.stop.addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
    el.clear.addEventListener("click", () => {
      if (chat.controller) chat.controller.abort();
      chat.history = [];
      el.messages.replaceChildren();
      showError("");
    });
    el.attachLabel.hidden = document.body.dataset.vision !== "1";
    el.image.addEventListener("change", readImage);
    el.removeImage.addEventListener("click", () => setImage(null));
    setStreaming(false);
    loadModels();
  }

  wire();
})();
