// specdec playground: plain JS, no build step, no external requests. Every request goes to this
// page's own origin, with the API key the user typed (kept in sessionStorage: this tab only).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "specdec.playground.key";
  const params = new URLSearchParams(location.search);
  const REFRESH_MS = Math.max(100, Number(params.get("refresh")) || 2000);
  const TOP_N = 5; // alternatives asked per token

  // Where a token came from (the server's `token_sources[].source`), its legend and meaning.
  const SOURCES = [
    ["forced", "forced", "the grammar allowed exactly one token"],
    ["looked_up", "looked up", "proposed by prompt lookup and accepted"],
    ["suffixed", "earlier answers", "proposed from earlier answers and accepted"],
    ["drafted", "drafted", "proposed by the draft model and accepted"],
    ["branch", "tree branch", "accepted on a token-tree branch"],
    ["target", "target", "the target model's own pick"],
    ["budget", "budget", "the token budget steered the answer closed"],
  ];
  const SOURCE = Object.fromEntries(SOURCES.map(([k, label, what]) => [k, { label, what }]));
  // The `specdec` counters of each proposal source: [proposed, accepted].
  const COUNTERS = {
    forced: ["forced", "forced_accepted"], looked_up: ["looked_up", "looked_up_accepted"],
    suffixed: ["suffixed", "suffixed_accepted"], drafted: ["drafted", "drafted_accepted"],
    branch: ["branched", "branched_accepted"],
  };
  const API_NAME = { chat: "Chat Completions", responses: "Responses", messages: "Messages" };

  // -- ready examples per constraint kind ------------------------------------------------------
  const j = (v) => JSON.stringify(v, null, 2);
  const EXAMPLES = {
    json_schema: [
      ["person: name + age", j({
        type: "object", additionalProperties: false, required: ["name", "age"],
        properties: { name: { type: "string", maxLength: 40 },
                      age: { type: "integer", minimum: 0, maximum: 120 } } })],
      ["contact: email (format)", j({
        type: "object", additionalProperties: false, required: ["name", "email"],
        properties: { name: { type: "string", maxLength: 30 },
                      email: { type: "string", format: "email" } } })],
      ["sentiment: enum", j({
        type: "object", additionalProperties: false, required: ["sentiment", "confidence"],
        properties: { sentiment: { enum: ["positive", "neutral", "negative"] },
                      confidence: { type: "number", minimum: 0, maximum: 1 } } })],
      ["shopping list: nested", j({
        type: "object", additionalProperties: false, required: ["title", "items"],
        properties: {
          title: { type: "string", maxLength: 30 },
          items: { type: "array", minItems: 1, maxItems: 3, items: {
            type: "object", additionalProperties: false, required: ["name", "qty"],
            properties: { name: { type: "string", maxLength: 20 },
                          qty: { type: "integer", minimum: 1, maximum: 99 } } } } } })],
    ],
    json_object: [],
    regex: [
      ["yes/no with a reason", "(yes|no), because [a-z ]{3,40}\\."],
      ["ISO date", "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"],
      ["phone number", "\\+1 \\([0-9]{3}\\) [0-9]{3}-[0-9]{4}"],
    ],
    grammar: [
      ["a number answer", 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'],
      ["a short list", 'start: "- " item ("\\n- " item)~0..2\nitem: /[A-Za-z ]{1,20}/'],
    ],
    choice: [
      ["sentiment", "positive\nneutral\nnegative"],
      ["colours", "red\ngreen\nblue"],
    ],
    tools: [
      ["weather", j([{ type: "function", function: {
        name: "get_weather", description: "Current weather in a city",
        parameters: { type: "object", required: ["city"], properties: {
          city: { type: "string" }, unit: { enum: ["celsius", "fahrenheit"] } } } } }])],
      ["weather + search", j([
        { type: "function", function: { name: "get_weather", description: "Current weather in a city",
          parameters: { type: "object", required: ["city"], properties: { city: { type: "string" } } } } },
        { type: "function", function: { name: "web_search", description: "Search the web",
          parameters: { type: "object", required: ["query"], properties: { query: { type: "string" } } } } }])],
    ],
  };
  const TEXT_LABEL = { json_schema: "Schema (JSON)", regex: "Regex", grammar: "Lark grammar",
                       choice: "Choices, one per line", tools: "Tools (JSON array of functions)" };

  const state = {
    key: sessionStorage.getItem(KEY_STORE) || "",
    conversation: [], // {role: "user", text} | {role: "assistant", text, reasoning, calls} | {role: "tool", results}
    texts: {},        // the constraint text per kind, as the user left it
    running: null,    // the AbortController of the request in flight
    tokenSources: true, // false once the server refused `token_sources`
    noThinking: new Set(), // models that answered thinking_unsupported
    tokens: [],       // every token shown (a span's data-i indexes it)
    pendingCalls: null, // the calls the next message answers
  };

  // -- small helpers ---------------------------------------------------------------------------
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k in e && typeof v !== "string") e[k] = v;
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }
  const fmt = (x, d = 1) => (typeof x === "number" && isFinite(x) ? x.toFixed(d) : "—");
  const pct = (x) => (typeof x === "number" && isFinite(x) ? (100 * x).toFixed(0) + "%" : "—");
  function bytes(n) {
    if (typeof n !== "number") return "—";
    if (n < 1024) return n + " B";
    if (n < 1 << 20) return (n / 1024).toFixed(1) + " KiB";
    return (n / (1 << 20)).toFixed(1) + " MiB";
  }
  // A token's text with its whitespace made visible.
  function visible(s) {
    return String(s).replace(/[\s\u0000-\u001f\u007f]/gu, (c) => (
      { " ": "·", "\n": "↵", "\t": "→", "\r": "␍" }[c] ||
      "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0")));
  }

  function authHeaders(api) {
    const h = { "content-type": "application/json" };
    if (api === "messages") {
      h["anthropic-version"] = "2023-06-01";
      if (state.key) h["x-api-key"] = state.key;
    } else if (state.key) {
      h.authorization = "Bearer " + state.key;
    }
    return h;
  }

  function authProblem(show) {
    const b = $("auth-banner");
    if (!show) { b.hidden = true; return; }
    b.textContent = state.key
      ? "The server refused the API key (401). Check the key in the “API key” field above."
      : "This server needs an API key (401). Enter it in the “API key” field above; " +
        "it is kept in this tab only.";
    b.hidden = false;
  }

  // -- legend ----------------------------------------------------------------------------------
  function buildLegend() {
    const legend = $("legend");
    for (const [k, label, what] of SOURCES) {
      legend.append(el("span", { class: "item", title: what },
        el("span", { class: "tok src-" + k, "data-source": k, "aria-hidden": "true", text: "ab" }),
        el("span", { text: label })));
    }
  }

  // -- constraint editor -----------------------------------------------------------------------
  function kind() { return $("constraint").value; }

  function fillExamples() {
    const k = kind(), ex = EXAMPLES[k] || [];
    const sel = $("example");
    sel.replaceChildren(el("option", { value: "", text: ex.length ? "choose…" : "—" }),
      ...ex.map(([label], i) => el("option", { value: String(i), text: label })));
    $("example-field").hidden = !ex.length;
    const hasText = k in TEXT_LABEL;
    $("constraint-text-field").hidden = !hasText;
    $("strict-field").hidden = k !== "json_schema";
    $("tool-choice-field").hidden = k !== "tools";
    if (hasText) {
      $("constraint-text-label").textContent = TEXT_LABEL[k];
      if (state.texts[k] === undefined) state.texts[k] = ex.length ? ex[0][1] : "";
      $("constraint-text").value = state.texts[k];
      if (ex.length && state.texts[k] === ex[0][1]) sel.value = "0";
    }
    refreshToolChoice();
    checkConstraint();
  }

  // Tools as the page keeps them: [{name, description, parameters}], from any API's shape.
  function parseTools(text) {
    let v;
    try { v = JSON.parse(text); } catch (e) { return { error: "tools: not JSON (" + e.message + ")" }; }
    if (!Array.isArray(v)) v = [v];
    const tools = [];
    for (const t of v) {
      const f = t && t.type === "function" && t.function ? t.function : t;
      if (!f || typeof f.name !== "string" || !f.name) return { error: "tools: every tool needs a name" };
      tools.push({ name: f.name, description: f.description,
                   parameters: f.parameters || f.input_schema || { type: "object", properties: {} } });
    }
    if (!tools.length) return { error: "tools: the list is empty" };
    return { tools };
  }

  function refreshToolChoice() {
    const sel = $("tool-choice"), was = sel.value || "auto";
    const parsed = kind() === "tools" ? parseTools($("constraint-text").value) : { tools: [] };
    const opts = ["auto", "required", "none"].map((v) => el("option", { value: v, text: v }));
    for (const t of parsed.tools || []) opts.push(el("option", { value: "fn:" + t.name, text: "function: " + t.name }));
    sel.replaceChildren(...opts);
    sel.value = [...sel.options].some((o) => o.value === was) ? was : "auto";
  }

  // The request fields of the constraint for `api`, or {error} where that API cannot take it.
  function constraintFields(api) {
    const k = kind(), text = $("constraint-text").value;
    const no = (what, use) => ({ error: `${API_NAME[api]} cannot take ${what}: ${use}` });
    if (k === "none") return { fields: {} };
    if (k === "json_schema") {
      let schema;
      try { schema = JSON.parse(text); } catch (e) { return { error: "schema: not JSON (" + e.message + ")" }; }
      if (schema === null || typeof schema !== "object" || Array.isArray(schema)) return { error: "schema: must be a JSON object" };
      const strict = $("strict").checked;
      if (api === "chat") return { fields: { response_format: { type: "json_schema", json_schema: { name: "answer", schema, strict } } }, schema };
      if (api === "responses") return { fields: { text: { format: { type: "json_schema", name: "answer", schema, strict } } }, schema };
      return { fields: { output_config: { format: { type: "json_schema", schema } } }, schema };
    }
    if (k === "json_object") {
      if (api === "chat") return { fields: { response_format: { type: "json_object" } } };
      if (api === "responses") return { fields: { text: { format: { type: "json_object" } } } };
      return no("json_object", "give a JSON schema, or use Chat Completions or Responses");
    }
    if (k === "regex" || k === "grammar" || k === "choice") {
      const what = { regex: "a regex", grammar: "a grammar", choice: "a choice" }[k];
      if (api !== "chat") return no(what, "only Chat Completions takes it (structured_outputs)");
      if (k === "choice") {
        const choice = text.split("\n").map((s) => s.trim()).filter(Boolean);
        if (!choice.length) return { error: "choice: give at least one option, one per line" };
        return { fields: { structured_outputs: { choice } } };
      }
      if (!text.trim()) return { error: what + " is empty" };
      return { fields: { structured_outputs: { [k]: text } } };
    }
    if (k === "tools") {
      const parsed = parseTools(text);
      if (parsed.error) return parsed;
      const choice = $("tool-choice").value, name = choice.startsWith("fn:") ? choice.slice(3) : null;
      const ts = parsed.tools;
      if (api === "chat") return { tools: ts, fields: {
        tools: ts.map((t) => ({ type: "function", function: { name: t.name, description: t.description, parameters: t.parameters } })),
        tool_choice: name ? { type: "function", function: { name } } : choice } };
      if (api === "responses") return { tools: ts, fields: {
        tools: ts.map((t) => ({ type: "function", name: t.name, description: t.description, parameters: t.parameters })),
        tool_choice: name ? { type: "function", name } : choice } };
      return { tools: ts, fields: {
        tools: ts.map((t) => ({ name: t.name, description: t.description, input_schema: t.parameters })),
        tool_choice: name ? { type: "tool", name } : { type: { auto: "auto", required: "any", none: "none" }[choice] } } };
    }
    return { fields: {} };
  }

  function checkConstraint() {
    const note = $("constraint-note"), c = constraintFields($("api").value);
    note.textContent = c.error || "";
    note.className = c.error ? "note warn" : "note";
    const t = $("thinking-note");
    t.textContent = state.noThinking.has($("model").value)
      ? "This model's chat template writes no reasoning markers: it cannot think." : "";
    $("thinking").disabled = state.noThinking.has($("model").value);
  }

  // -- building a request ----------------------------------------------------------------------
  const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };

  function historyFor(api) {
    const out = [];
    for (const turn of state.conversation) {
      if (turn.role === "user") {
        out.push({ role: "user", content: turn.text });
      } else if (turn.role === "tool") {
        if (api === "chat") for (const r of turn.results) out.push({ role: "tool", tool_call_id: r.id, content: r.text });
        else if (api === "responses") for (const r of turn.results) out.push({ type: "function_call_output", call_id: r.id, output: r.text });
        else out.push({ role: "user", content: turn.results.map((r) => ({ type: "tool_result", tool_use_id: r.id, content: r.text })) });
      } else if (api === "chat") {
        const m = { role: "assistant", content: turn.calls.length ? (turn.text || null) : turn.text };
        if (turn.calls.length) m.tool_calls = turn.calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments || "{}" } }));
        out.push(m);
      } else if (api === "responses") {
        if (turn.text || !turn.calls.length) out.push({ type: "message", role: "assistant", content: [{ type: "output_text", text: turn.text }] });
        for (const c of turn.calls) out.push({ type: "function_call", call_id: c.id, name: c.name, arguments: c.arguments || "{}" });
      } else {
        const content = [];
        if (turn.text || !turn.calls.length) content.push({ type: "text", text: turn.text || " " });
        for (const c of turn.calls) {
          let input = {};
          try { input = JSON.parse(c.arguments || "{}"); } catch (e) { /* sent as {} */ }
          content.push({ type: "tool_use", id: c.id, name: c.name, input });
        }
        out.push({ role: "assistant", content });
      }
    }
    return out;
  }

  function buildRequest(api, constraint) {
    const system = $("system").value.trim();
    const maxTokens = num("max-tokens");
    const body = { model: $("model").value || "default", stream: true };
    const t = num("temperature"), p = num("top-p"), seed = num("seed");
    if (t !== undefined) body.temperature = t;
    if (p !== undefined) body.top_p = p;
    if (seed !== undefined) body.seed = seed;
    const thinking = $("thinking").checked && !$("thinking").disabled;
    if (api === "chat") {
      body.messages = [...(system ? [{ role: "system", content: system }] : []), ...historyFor(api)];
      if (maxTokens !== undefined) body.max_tokens = maxTokens;
      body.stream_options = { include_usage: true };
      if (thinking) body.reasoning_effort = "medium";
    } else if (api === "responses") {
      body.input = historyFor(api);
      if (system) body.instructions = system;
      if (maxTokens !== undefined) body.max_output_tokens = maxTokens;
      body.store = false;
      if (thinking) body.reasoning = { effort: "medium" };
    } else {
      body.messages = historyFor(api);
      if (system) body.system = system;
      body.max_tokens = maxTokens !== undefined ? maxTokens : 256;
      if (thinking) body.thinking = { type: "enabled", budget_tokens: Math.max(1, Math.floor(body.max_tokens / 2)) };
    }
    Object.assign(body, constraint.fields);
    // Our extensions (every API): speculation and the token budget's rule.
    if (!$("spec").checked) body.num_draft_tokens = 0;
    else {
      const k = num("k");
      if (k !== undefined) body.num_draft_tokens = k;
      if ($("lookup").value) body.prompt_lookup = $("lookup").value === "on";
      if ($("masking").value) body.draft_masking = $("masking").value === "on";
      const tree = num("tree");
      if (tree !== undefined) body.tree_tokens = tree;
    }
    if (!$("close-at-budget").checked) body.close_at_budget = false;
    if (state.tokenSources) body.token_sources = TOP_N;
    const path = { chat: "/v1/chat/completions", responses: "/v1/responses", messages: "/v1/messages" }[api];
    return { path, body };
  }

  // -- the transcript --------------------------------------------------------------------------
  function showError(msg) {
    const e = $("error");
    e.textContent = msg || "";
    e.hidden = !msg;
    if (msg) announce("");
  }

  function addTurnElement(turn) {
    $("transcript-empty").hidden = true;
    let node;
    if (turn.role === "user") {
      node = el("div", { class: "turn user" }, el("div", { class: "who", text: "user" }),
        el("div", { class: "body", text: turn.text }));
    } else {
      node = el("div", { class: "turn tool-result" }, el("div", { class: "who", text: "tool result" }),
        ...turn.results.map((r) => el("div", { class: "body", text: r.name + " → " + r.text })));
    }
    $("transcript").append(node);
    return node;
  }

  // One assistant answer as it streams: its text, reasoning and calls, each token a span.
  class Answer {
    constructor() {
      this.text = ""; this.reasoning = ""; this.calls = []; this.callsByKey = new Map();
      this.tokens = []; this.node = el("div", { class: "turn assistant" },
        el("div", { class: "who", text: "assistant" }));
      this.reasonBox = el("details", { class: "reasoning", hidden: true },
        el("summary", { text: "Reasoning" }));
      this.reasonBody = el("div", { class: "body answer" });
      this.reasonBox.append(this.reasonBody);
      this.body = el("div", { class: "body answer" });
      this.callsBox = el("div", { class: "calls" });
      this.markup = el("div", { class: "markup", hidden: true },
        el("span", { text: "Tokens outside the text: " }));
      this.markupToks = el("span", { class: "toks" });
      this.markup.append(this.markupToks);
      this.node.append(this.reasonBox, this.body, this.callsBox, this.markup);
      $("transcript-empty").hidden = true;
      $("transcript").append(this.node);
    }

    span(tok) {
      const i = state.tokens.length;
      state.tokens.push(tok);
      this.tokens.push(tok);
      const src = SOURCE[tok.source] ? tok.source : "unknown";
      const label = (SOURCE[src] ? SOURCE[src].label : "unknown source") + " token " +
        JSON.stringify(tok.text ?? "");
      return el("span", { class: "tok src-" + src + (tok.text ? "" : " empty-text"), tabindex: "0",
        "data-i": String(i), "data-source": src, "aria-label": label, text: tok.text ?? "" });
    }

    // Append `delta` to `box`: as token spans where the first tokens spell it (any tokens
    // after those, such as markup closing the answer, go to the markup line), else as plain
    // text with every token apart, in the markup line.
    put(box, delta, tokens) {
      const toks = Array.isArray(tokens) ? tokens : [];
      let n = 0;
      if (delta) {
        let spelt = "";
        while (n < toks.length && spelt.length < delta.length) spelt += toks[n++].text ?? "";
        if (spelt !== delta) n = 0;
        else while (n < toks.length && !toks[n].text) n++; // with any textless tokens after
      }
      if (n) box.append(...toks.slice(0, n).map((t) => this.span(t)));
      else if (delta) box.append(el("span", { class: "plain", text: delta }));
      const rest = toks.slice(n);
      if (rest.length && !delta && rest.every((t) => !t.text)) {
        box.append(...rest.map((t) => this.span(t))); // tokens with no text at all: in place
      } else if (rest.length) {
        this.markup.hidden = false;
        this.markupToks.append(...rest.map((t) => this.span(t)));
      }
    }

    addText(delta, tokens) { this.text += delta || ""; this.put(this.body, delta || "", tokens); }

    addReasoning(delta, tokens) {
      this.reasoning += delta || "";
      if (this.reasonBox.hidden) { this.reasonBox.hidden = false; this.reasonBox.open = true; }
      this.put(this.reasonBody, delta || "", tokens);
    }

    call(key, info) {
      let c = this.callsByKey.get(key);
      if (!c) {
        c = { id: info.id || "call_" + key, name: info.name || "", arguments: "" };
        c.nameEl = el("div", { class: "tool-name", text: c.name });
        c.argsEl = el("pre", { class: "tool-args" });
        c.rawEl = el("div", { class: "raw", "aria-label": "the call's tokens" });
        c.checkEl = el("div", { class: "tool-check" });
        c.card = el("div", { class: "tool-card", role: "group", "aria-label": "tool call " + c.name },
          c.nameEl, c.argsEl, c.rawEl, c.checkEl);
        this.callsBox.append(c.card);
        this.callsByKey.set(key, c);
        this.calls.push(c);
      }
      if (info.id) c.id = info.id;
      if (info.name && !c.name) { c.name = info.name; c.nameEl.textContent = info.name; c.card.setAttribute("aria-label", "tool call " + info.name); }
      return c;
    }

    addArgs(key, delta, tokens) {
      const c = this.call(key, {});
      c.arguments += delta || "";
      c.argsEl.textContent = c.arguments;
      for (const t of Array.isArray(tokens) ? tokens : []) c.rawEl.append(this.span(t));
    }

    // Orphan tokens (a chunk with tokens and no text): shown apart.
    addTokens(tokens) { this.put(this.body, "", tokens); }

    // The answer is over: `cut` (a reason) where it did not finish, its calls then unchecked.
    finish(tools, cut) {
      this.node.classList.add("done");
      if (cut) {
        this.node.classList.add("cut");
        this.node.append(el("div", { class: "note warn cut-note", text: "cut off: " + cut }));
      }
      for (const c of this.calls) {
        const verdict = (text, how) => {
          c.checkEl.textContent = text;
          c.checkEl.className = "tool-check validation " + how;
        };
        if (cut) { verdict("arguments not checked: the call was cut off", "unchecked"); continue; }
        let args;
        try { args = JSON.parse(c.arguments || "{}"); } catch (e) {
          verdict("arguments are not JSON (" + e.message + ")", "invalid");
          continue;
        }
        c.argsEl.textContent = JSON.stringify(args, null, 2);
        const tool = (tools || []).find((t) => t.name === c.name);
        if (!tool) continue;
        const r = check(tool.parameters, args);
        if (r.error) verdict("arguments invalid: " + r.error, "invalid");
        else if (r.unchecked.length) verdict("arguments: " + r.unchecked.join("; "), "unchecked");
        else verdict("arguments valid", "valid");
      }
      if (!this.text && !this.calls.length && !this.reasoning && !this.body.querySelector(".tok")) {
        this.body.textContent = "";
      }
    }
  }

  // -- streaming -------------------------------------------------------------------------------
  class StreamFailure extends Error {
    constructor(info) { super(info.message); this.info = info; }
  }

  // The stream's events, {event, data}; chat's closing `[DONE]` as {event, done: true}.
  async function* events(response) {
    const reader = response.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf = (buf + dec.decode(value, { stream: true })).replace(/\r\n?/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + 2);
        let event = "message", data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (!data.length) continue;
        const text = data.join("\n");
        if (text === "[DONE]") { yield { event, done: true }; return; }
        let json;
        try { json = JSON.parse(text); } catch (e) {
          const shown = text.length > 80 ? text.slice(0, 80) + "…" : text;
          throw new StreamFailure({ message: `the server sent an event that is not JSON (${e.message}): ${shown}` });
        }
        yield { event, data: json };
      }
    }
  }

  function errorOf(body) {
    const e = body && body.error;
    if (!e) return { message: typeof body === "string" ? body : JSON.stringify(body) };
    return { message: e.message || String(e), code: e.code || e.type, param: e.param };
  }

  // Reads one API's stream into `answer`; returns the final {finish, usage, specdec}, with
  // `cut` set where the stream ended before its final event (the answer did not finish).
  // A closing event's `token_sources` are the tokens no delta's text stood for (markup that
  // closes a call or a think block): they join the answer's tokens, apart from its text.
  async function consume(api, response, answer, mark) {
    const fin = { finish: null, usage: null, specdec: null, warnings: response.headers.get("warning"),
                  cut: false };
    let ended = false; // the API's final event came
    const closing = (toks) => { if (Array.isArray(toks) && toks.length) { mark(); answer.addTokens(toks); } };
    for await (const { event, data, done } of events(response)) {
      if (done) { if (api === "chat") ended = true; continue; }
      if (data === null || typeof data !== "object") {
        throw new StreamFailure({ message: "the server sent an event that is not a JSON object: " + JSON.stringify(data) });
      }
      if (api === "chat") {
        if (data.error) throw new StreamFailure(errorOf(data));
        for (const ch of data.choices || []) {
          const d = ch.delta || {}, toks = ch.token_sources;
          let used = false;
          const reasoning = d.reasoning_content ?? d.reasoning;
          if (reasoning) { mark(); answer.addReasoning(reasoning, toks); used = true; }
          if (d.content) { mark(); answer.addText(d.content, used ? null : toks); used = true; }
          for (const tc of d.tool_calls || []) {
            mark();
            answer.call(tc.index ?? 0, { id: tc.id, name: tc.function && tc.function.name });
            answer.addArgs(tc.index ?? 0, (tc.function && tc.function.arguments) || "", used ? null : toks);
            used = true;
          }
          if (!used && toks && toks.length) { mark(); answer.addTokens(toks); }
          if (ch.finish_reason) { fin.finish = ch.finish_reason; ended = true; }
        }
        if (data.usage) fin.usage = data.usage;
        if (data.specdec) fin.specdec = data.specdec;
      } else if (api === "responses") {
        const type = data.type || event, toks = data.token_sources;
        if (type === "response.output_item.added" && data.item && data.item.type === "function_call") {
          mark(); answer.call(data.output_index, { id: data.item.call_id, name: data.item.name });
        } else if (type === "response.output_text.delta") { mark(); answer.addText(data.delta, toks); }
        else if (type === "response.reasoning_text.delta") { mark(); answer.addReasoning(data.delta, toks); }
        else if (type === "response.function_call_arguments.delta") { mark(); answer.addArgs(data.output_index, data.delta, toks); }
        else if (type === "response.completed" || type === "response.incomplete") {
          const r = data.response || {};
          closing(toks);
          fin.finish = (r.status || type.slice(9)) + (r.incomplete_details ? " (" + r.incomplete_details.reason + ")" : "");
          fin.usage = r.usage; fin.specdec = r.specdec;
          ended = true;
        } else if (type === "response.failed") {
          throw new StreamFailure(errorOf(data.response || {}));
        } else if (type === "error") {
          throw new StreamFailure({ message: data.message || (data.error && data.error.message) || "error", code: data.code });
        }
      } else {
        const type = data.type || event, toks = data.token_sources;
        if (type === "message_start") fin.usage = data.message && data.message.usage;
        else if (type === "content_block_start") {
          const b = data.content_block || {};
          if (b.type === "tool_use") { mark(); answer.call(data.index, { id: b.id, name: b.name }); }
        } else if (type === "content_block_delta") {
          const d = data.delta || {};
          if (d.type === "text_delta") { mark(); answer.addText(d.text, toks); }
          else if (d.type === "thinking_delta") { mark(); answer.addReasoning(d.thinking, toks); }
          else if (d.type === "input_json_delta") { mark(); answer.addArgs(data.index, d.partial_json, toks); }
          else if (toks && toks.length) answer.addTokens(toks);
        } else if (type === "message_delta") {
          closing(toks);
          fin.finish = data.delta && data.delta.stop_reason;
          fin.usage = Object.assign({}, fin.usage, data.usage);
          if (data.specdec) fin.specdec = data.specdec;
        } else if (type === "message_stop") {
          ended = true;
        } else if (type === "error") {
          throw new StreamFailure(errorOf(data));
        }
      }
    }
    if (!ended) {
      fin.cut = true;
      fin.finish = fin.finish ? fin.finish + " (cut off)" : "cut off";
    }
    return fin;
  }

  // -- the request panel -----------------------------------------------------------------------
  function resetStats() {
    for (const id of ["stat-ttft", "stat-tps", "stat-acceptance", "stat-rounds", "stat-compile",
                      "stat-budget", "stat-finish", "stat-usage", "stat-validation"]) $(id).textContent = "—";
    $("stat-validation").className = "validation";
    $("stat-sources").tBodies[0].replaceChildren();
    $("stat-warnings").textContent = "";
  }

  function usageText(api, u) {
    if (!u) return "—";
    const input = u.prompt_tokens ?? u.input_tokens, output = u.completion_tokens ?? u.output_tokens;
    const cached = (u.prompt_tokens_details || u.input_tokens_details || {}).cached_tokens ?? u.cache_read_input_tokens;
    const reasoning = (u.completion_tokens_details || u.output_tokens_details || {}).reasoning_tokens;
    let s = `${input ?? "?"} in / ${output ?? "?"} out`;
    if (cached) s += ` · ${cached} cached`;
    if (reasoning) s += ` · ${reasoning} reasoning`;
    return s;
  }

  function showStats(api, answer, fin, t, constraint) {
    const sd = fin.specdec || {}, u = fin.usage || {};
    const out = u.completion_tokens ?? u.output_tokens ?? answer.tokens.length;
    $("stat-ttft").textContent = t.first ? fmt(t.first - t.start, 0) + " ms" : "—";
    const wall = (t.end - (t.first || t.start)) / 1000;
    const parts = [];
    if (typeof sd.tokens_per_s === "number") parts.push(fmt(sd.tokens_per_s) + " tok/s (server)");
    else if (sd.seconds > 0 && out) parts.push(fmt(out / sd.seconds) + " tok/s (server)");
    if (wall > 0 && out) parts.push(fmt(out / wall) + " after the first token");
    $("stat-tps").textContent = parts.join(" · ") || "—";
    $("stat-acceptance").textContent = typeof sd.acceptance_rate === "number"
      ? `${pct(sd.acceptance_rate)} (${sd.accepted}/${sd.proposed} proposed)` : "—";
    $("stat-rounds").textContent = sd.rounds !== undefined
      ? `${sd.rounds}` + (sd.k !== undefined ? ` · k ${sd.k}` : "") : "—";
    const cparts = [];
    if (typeof sd.compile_s === "number") cparts.push(fmt(sd.compile_s * 1000) + " ms");
    if (typeof sd.prepare_s === "number") cparts.push("prepared in " + fmt(sd.prepare_s * 1000) + " ms");
    if (typeof sd.mask_s === "number") cparts.push("masks " + fmt(sd.mask_s * 1000) + " ms");
    $("stat-compile").textContent = cparts.join(" · ") || "—";
    const minimum = sd.budget_minimum;
    const bparts = [];
    if (minimum !== undefined && minimum !== null) bparts.push("minimum " + minimum);
    if (sd.budget_steered !== undefined) bparts.push(sd.budget_steered + " steered");
    if (sd.budget_unguaranteed) bparts.push("unguaranteed: " + sd.budget_unguaranteed);
    $("stat-budget").textContent = bparts.join(" · ") || "—";
    $("stat-finish").textContent = fin.finish || "—";
    $("stat-usage").textContent = usageText(api, fin.usage);

    // tokens by source (counted from the token sources) and proposals (the counters)
    const counts = {};
    for (const tok of answer.tokens) counts[tok.source] = (counts[tok.source] || 0) + 1;
    const rows = [];
    for (const [k, label] of SOURCES) {
      const c = COUNTERS[k];
      const prop = c ? sd[c[0]] : undefined, acc = c ? sd[c[1]] : undefined;
      const n = counts[k] || 0;
      const ap = prop !== undefined ? `${acc}/${prop}` : k === "budget" && sd.budget_steered !== undefined ? `${sd.budget_steered} steered` : "";
      if (!n && !prop && !(k === "budget" && sd.budget_steered)) continue;
      rows.push(el("tr", { "data-source": k },
        el("td", {}, el("span", { class: "tok src-" + k, "aria-hidden": "true", text: "ab" }), " " + label),
        el("td", { text: answer.tokens.length ? String(n) : "—" }), el("td", { text: ap })));
    }
    $("stat-sources").tBodies[0].replaceChildren(...rows);
    const warnings = [...(sd.warnings || [])];
    if (fin.warnings && !warnings.length) warnings.push(fin.warnings);
    if (!state.tokenSources) warnings.push("this server does not report token sources: tokens are shown uncoloured");
    $("stat-warnings").textContent = warnings.length ? "Warnings: " + warnings.join("; ") : "";

    // the answer checked against the schema, here in the page
    const v = $("stat-validation");
    if (constraint.schema !== undefined || kind() === "json_object") {
      const verdict = (text, how) => { v.textContent = text; v.className = "validation " + how; };
      let value, err = null, unchecked = [];
      try { value = JSON.parse(answer.text); } catch (e) { err = "not JSON: " + e.message; }
      if (fin.cut) verdict("not checked: the answer was cut off", "unchecked");
      else {
        if (!err && constraint.schema !== undefined) ({ error: err, unchecked } = check(constraint.schema, value));
        else if (!err) err = value && typeof value === "object" && !Array.isArray(value) ? null : "not a JSON object";
        if (err) verdict("invalid: " + err, "invalid");
        else if (unchecked.length) verdict(unchecked.join("; "), "unchecked");
        else verdict("valid", "valid");
      }
    }
  }

  // -- JSON-schema validation (a subset: what constrained answers need) -------------------------
  function typeOf(v) {
    if (v === null) return "null";
    if (Array.isArray(v)) return "array";
    if (typeof v === "number") return Number.isInteger(v) ? "integer" : "number";
    return typeof v;
  }
  function equal(a, b) {
    if (a === b) return true;
    if (typeof a !== typeof b || a === null || b === null || typeof a !== "object") return false;
    if (Array.isArray(a) !== Array.isArray(b)) return false;
    const ka = Object.keys(a), kb = Object.keys(b);
    return ka.length === kb.length && ka.every((k) => k in b && equal(a[k], b[k]));
  }
  const FORMATS = {
    email: /^[^\s@]+@[^\s@]+$/,
    date: /^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$/,
    "date-time": /^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$/,
    time: /^\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})?$/,
    uuid: /^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$/,
    ipv4: /^((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)$/,
  };
  // Keywords this page does not check: where one applies, the answer is "not checked".
  const UNCHECKED = ["if", "contains", "dependentRequired", "dependentSchemas", "dependencies",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef"];
  const REF_DEPTH = 32; // $refs followed within one another, at most
  const REGEXES = new Map();
  // `pattern` as a JS regex (u flag), or {error} where JS cannot read it.
  function regex(p) {
    if (!REGEXES.has(p)) {
      let r;
      try { r = { re: new RegExp(p, "u") }; } catch (e) { r = { error: e.message }; }
      REGEXES.set(p, r);
    }
    return REGEXES.get(p);
  }
  const own = (o, k) => Object.prototype.hasOwnProperty.call(o, k);
  function resolve(root, ref) {
    if (typeof ref !== "string" || !ref.startsWith("#")) return undefined;
    let node = root;
    for (const raw of ref.slice(1).split("/").filter(Boolean)) {
      let key;
      try { key = decodeURIComponent(raw).replace(/~1/g, "/").replace(/~0/g, "~"); } catch (e) { return undefined; }
      node = node !== null && typeof node === "object" && own(node, key) ? node[key] : undefined;
    }
    return node;
  }
  // `value` checked against `schema`: {error} ("path: what", or null) and `unchecked`, what the
  // page could not check ("pattern not checked in the page: ..."). Only null with nothing
  // unchecked means valid.
  function check(schema, value) {
    const ctx = { notes: [], refs: [] };
    let error = null;
    try { error = validate(schema, value, "$", schema, ctx); } catch (e) {
      ctx.notes.push("schema not checked in the page: " + (e && e.message || e));
    }
    return { error, unchecked: error ? [] : [...new Set(ctx.notes)] };
  }
  // The first error of `value` against `schema`, as "path: what", or null; what it could not
  // check goes to `ctx.notes`.
  function validate(schema, value, path, root, ctx) {
    if (schema === true || schema === undefined) return null;
    if (schema === false) return `${path}: no value is allowed here`;
    const s = JSON.stringify;
    const note = (what) => { ctx.notes.push(what); };
    if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
      note(`schema not checked in the page: ${path}: ${s(schema)} is not a schema`);
      return null;
    }
    // A branch (anyOf, oneOf, not): its error and its own notes.
    const branch = (sub) => {
      const c = { notes: [], refs: ctx.refs };
      return { error: validate(sub, value, path, root, c), notes: c.notes };
    };
    if (schema.$ref !== undefined) {
      const target = resolve(root, schema.$ref);
      if (target === undefined) {
        note(`$ref not checked in the page: ${path}: ${s(schema.$ref)} is not a reference within the schema`);
      } else if (ctx.refs.some(([t, v]) => t === target && v === value)) {
        note(`$ref not checked in the page: ${path}: ${s(schema.$ref)} refers to itself`);
      } else if (ctx.refs.length >= REF_DEPTH) {
        note(`$ref not checked in the page: ${path}: ${s(schema.$ref)} nests more than ${REF_DEPTH} deep`);
      } else {
        ctx.refs.push([target, value]);
        let e;
        try { e = validate(target, value, path, root, ctx); } finally { ctx.refs.pop(); }
        if (e) return e;
      }
    }
    for (const k of UNCHECKED) if (schema[k] !== undefined) note(`keyword ${s(k)} not checked in the page: ${path}`);
    const t = typeOf(value);
    if (schema.type !== undefined) {
      const types = Array.isArray(schema.type) ? schema.type : [schema.type];
      if (!types.some((ty) => ty === t || (ty === "number" && t === "integer"))) return `${path}: expected ${types.join(" or ")}, got ${t}`;
    }
    if (schema.enum && !schema.enum.some((e) => equal(e, value))) return `${path}: ${s(value)} is not one of ${s(schema.enum)}`;
    if ("const" in schema && !equal(schema.const, value)) return `${path}: expected ${s(schema.const)}`;
    if (t === "string") {
      const n = [...value].length;
      if (schema.minLength !== undefined && n < schema.minLength) return `${path}: shorter than ${schema.minLength} characters`;
      if (schema.maxLength !== undefined && n > schema.maxLength) return `${path}: longer than ${schema.maxLength} characters`;
      if (schema.pattern !== undefined) {
        const r = regex(schema.pattern);
        if (r.error) note(`pattern not checked in the page: ${path}: ${s(schema.pattern)} (${r.error})`);
        else if (!r.re.test(value)) return `${path}: ${s(value)} does not match ${schema.pattern}`;
      }
      if (schema.format !== undefined) {
        if (!own(FORMATS, schema.format)) note(`format not checked in the page: ${path}: ${s(schema.format)}`);
        else if (!FORMATS[schema.format].test(value)) return `${path}: ${s(value)} is not a valid ${schema.format}`;
      }
    }
    if (t === "number" || t === "integer") {
      if (schema.minimum !== undefined && value < schema.minimum) return `${path}: ${value} is below the minimum ${schema.minimum}`;
      if (schema.maximum !== undefined && value > schema.maximum) return `${path}: ${value} is above the maximum ${schema.maximum}`;
      if (typeof schema.exclusiveMinimum === "number" && value <= schema.exclusiveMinimum) return `${path}: ${value} is not above ${schema.exclusiveMinimum}`;
      if (typeof schema.exclusiveMaximum === "number" && value >= schema.exclusiveMaximum) return `${path}: ${value} is not below ${schema.exclusiveMaximum}`;
      if (schema.multipleOf && Math.abs(value / schema.multipleOf - Math.round(value / schema.multipleOf)) > 1e-9) return `${path}: ${value} is not a multiple of ${schema.multipleOf}`;
    }
    if (t === "array") {
      if (schema.minItems !== undefined && value.length < schema.minItems) return `${path}: fewer than ${schema.minItems} items`;
      if (schema.maxItems !== undefined && value.length > schema.maxItems) return `${path}: more than ${schema.maxItems} items`;
      const prefix = schema.prefixItems || (Array.isArray(schema.items) ? schema.items : []);
      const rest = Array.isArray(schema.items) ? schema.additionalItems : schema.items;
      for (let i = 0; i < value.length; i++) {
        const sub = i < prefix.length ? prefix[i] : rest;
        const e = sub === undefined ? null : validate(sub, value[i], `${path}[${i}]`, root, ctx);
        if (e) return e;
      }
      if (schema.uniqueItems) {
        for (let i = 0; i < value.length; i++) for (let k = 0; k < i; k++) {
          if (equal(value[i], value[k])) return `${path}: items ${k} and ${i} are equal`;
        }
      }
    }
    if (t === "object") {
      for (const r of schema.required || []) if (!own(value, r)) return `${path}: missing required property ${s(r)}`;
      const keys = Object.keys(value), props = schema.properties || {};
      if (schema.minProperties !== undefined && keys.length < schema.minProperties) return `${path}: fewer than ${schema.minProperties} properties`;
      if (schema.maxProperties !== undefined && keys.length > schema.maxProperties) return `${path}: more than ${schema.maxProperties} properties`;
      const patterns = Object.entries(schema.patternProperties || {});
      for (const k of keys) {
        const at = `${path}.${k}`;
        let matched = own(props, k);
        if (matched) { const e = validate(props[k], value[k], at, root, ctx); if (e) return e; }
        const unread = [];
        for (const [p, sub] of patterns) {
          const r = regex(p);
          if (r.error) { unread.push(`${s(p)} (${r.error})`); continue; }
          if (!r.re.test(k)) continue;
          matched = true;
          const e = validate(sub, value[k], at, root, ctx);
          if (e) return e;
        }
        if (unread.length) {
          // the property may match a pattern the page cannot read: its rules are unknown here
          note(`pattern not checked in the page: ${at}: patternProperties ${unread.join(", ")}`);
          continue;
        }
        if (matched) continue;
        if (schema.additionalProperties === false) return `${path}: property ${s(k)} is not allowed`;
        if (schema.additionalProperties && typeof schema.additionalProperties === "object") {
          const e = validate(schema.additionalProperties, value[k], at, root, ctx);
          if (e) return e;
        }
      }
    }
    if (schema.allOf) for (const sub of schema.allOf) { const e = validate(sub, value, path, root, ctx); if (e) return e; }
    if (schema.anyOf) {
      const rs = schema.anyOf.map(branch), ok = rs.filter((r) => !r.error);
      if (!ok.length) return `${path}: matches none of anyOf (${rs[0] ? rs[0].error : "an empty list"})`;
      if (!ok.some((r) => !r.notes.length)) for (const r of ok) ctx.notes.push(...r.notes);
    }
    if (schema.oneOf) {
      const rs = schema.oneOf.map(branch), ok = rs.filter((r) => !r.error);
      const sure = ok.filter((r) => !r.notes.length).length;
      if (!ok.length) return `${path}: matches none of oneOf (${rs[0] ? rs[0].error : "an empty list"})`;
      if (sure > 1) return `${path}: matches ${sure} of oneOf, not exactly one`;
      for (const r of ok) ctx.notes.push(...r.notes);
      if (ok.length > 1) note(`keyword "oneOf" not checked in the page: ${path}: ${ok.length} branches may match`);
    }
    if (schema.not !== undefined) {
      const r = branch(schema.not);
      if (!r.error && !r.notes.length) return `${path}: matches a schema under "not"`;
      if (!r.error) { ctx.notes.push(...r.notes); note(`keyword "not" not checked in the page: ${path}`); }
    }
    return null;
  }

  // -- sending ---------------------------------------------------------------------------------
  function announce(text) { $("status").textContent = text; }

  function setRunning(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
    document.body.dataset.busy = on ? "true" : "false";
  }

  function updateUserLabel() {
    const calls = state.pendingCalls;
    $("user-label").textContent = calls && calls.length
      ? "Tool result for " + calls.map((c) => c.name).join(", ") + " (sent as the call's result)"
      : "User message";
  }

  async function send() {
    if (state.running) return;
    showError("");
    const api = $("api").value;
    const constraint = constraintFields(api);
    if (constraint.error) { showError(constraint.error); return; }
    const text = $("user").value.trim();
    if (!text) { showError("Type a message first."); $("user").focus(); return; }
    const turn = state.pendingCalls && state.pendingCalls.length
      ? { role: "tool", results: state.pendingCalls.map((c) => ({ id: c.id, name: c.name, text })) }
      : { role: "user", text };
    state.conversation.push(turn);
    const turnNode = addTurnElement(turn);
    $("user").value = "";
    resetStats();
    announce("Sending…");
    const controller = new AbortController();
    state.running = controller;
    setRunning(true);
    const conversation = state.conversation; // "New conversation" replaces it
    let answer = null, stored = false;
    const t = { start: performance.now(), first: 0, end: 0 };
    const mark = () => { if (!t.first) t.first = performance.now(); };
    const undo = () => {
      if (state.conversation !== conversation) return;
      conversation.pop();
      turnNode.remove();
      if (answer) answer.node.remove();
      $("user").value = text;
      if (!$("transcript").querySelector(".turn")) $("transcript-empty").hidden = false;
    };
    try {
      for (let attempt = 0; ; attempt++) {
        const { path, body } = buildRequest(api, constraint);
        let response;
        try {
          response = await fetch(path, { method: "POST", headers: authHeaders(api), body: JSON.stringify(body), signal: controller.signal });
        } catch (e) {
          if (e.name === "AbortError") { undo(); return; }
          undo(); showError("Could not reach the server: " + e.message); return;
        }
        if (!response.ok) {
          let info;
          try { info = errorOf(await response.json()); } catch (e) { info = { message: response.statusText }; }
          if (response.status === 401) {
            authProblem(true); undo();
            showError(state.key ? "401: the server refused this API key. Check the “API key” field."
              : "401: this server needs an API key. Enter it in the “API key” field at the top.");
            $("error").classList.add("auth-error");
            return;
          }
          if (response.status === 400 && state.tokenSources && attempt === 0 &&
              (info.param === "token_sources" || /token_sources/.test(info.message || ""))) {
            state.tokenSources = false; // an older server: ask again without them
            document.documentElement.dataset.tokenSources = "off";
            continue;
          }
          if (info.code === "thinking_unsupported") {
            state.noThinking.add($("model").value);
            $("thinking").checked = false;
            checkConstraint();
          }
          undo();
          showError(`${response.status}: ${info.message}` + (info.code ? ` (${info.code})` : ""));
          return;
        }
        authProblem(false);
        $("error").classList.remove("auth-error");
        answer = new Answer();
        // fin.cut: why the answer did not finish (it is kept, marked cut off, without its calls)
        let fin, failure = "";
        try {
          fin = await consume(api, response, answer, mark);
          if (fin.cut) {
            fin.cut = "the stream ended before the answer finished";
            failure = "The stream ended before the answer finished (no final event came): " +
              "the answer above is cut off.";
          }
        } catch (e) {
          if (e.name === "AbortError") {
            fin = { finish: "stopped by you", cut: "stopped by you" };
          } else {
            const info = e.info || { message: e.message };
            failure = "The stream failed: " + info.message + (info.code ? ` (${info.code})` : "");
            fin = { finish: "error", cut: "the stream failed" };
          }
        }
        if (state.conversation !== conversation) return; // a new conversation began meanwhile
        t.end = performance.now();
        answer.finish(constraint.tools, fin.cut);
        const calls = fin.cut ? [] : answer.calls.map((c) => ({ id: c.id, name: c.name, arguments: c.arguments }));
        conversation.push({ role: "assistant", text: answer.text, reasoning: answer.reasoning, calls,
                            ...(fin.cut ? { cut: fin.cut } : {}) });
        stored = true;
        state.pendingCalls = calls.length ? calls.map((c) => ({ id: c.id, name: c.name })) : null;
        updateUserLabel();
        showStats(api, answer, fin, t, constraint);
        if (failure) showError(failure);
        announce((fin.cut ? `Answer cut off (${fin.cut})` : `Answer finished (${fin.finish || "done"})`) +
          `: ${answer.tokens.length || "no"} tokens` +
          (answer.calls.length ? `, ${answer.calls.length} tool call(s)` : "") + ".");
        return;
      }
    } catch (e) {
      // a fault in the page itself: the turn is undone, or its answer kept as cut off
      if (!answer) undo();
      else if (!stored && state.conversation === conversation) {
        answer.node.classList.add("done", "cut");
        conversation.push({ role: "assistant", text: answer.text, reasoning: answer.reasoning, calls: [],
                            cut: "the page failed" });
        state.pendingCalls = null;
        updateUserLabel();
      }
      showError("The page failed: " + describe(e));
    } finally {
      state.running = null;
      setRunning(false);
    }
  }

  const describe = (e) => (e && e.message) || String(e);

  // send(), with any error it throws shown in the page (not only in the console).
  function sendShown() {
    send().catch((e) => {
      state.running = null;
      setRunning(false);
      showError("The page failed: " + describe(e));
    });
  }

  function newConversation() {
    if (state.running) state.running.abort();
    state.conversation = [];
    state.tokens = [];
    state.pendingCalls = null;
    updateUserLabel();
    hideTip();
    $("transcript").replaceChildren($("transcript-empty"));
    $("transcript-empty").hidden = false;
    showError("");
    announce("");
    resetStats();
    $("user").focus();
  }

  // -- token details (hover or keyboard focus) -------------------------------------------------
  let tipFor = null;
  function showTip(span) {
    const tok = state.tokens[Number(span.dataset.i)];
    if (!tok) return;
    const tip = $("token-tip");
    const src = SOURCE[tok.source];
    const rows = [
      el("div", {}, el("span", { class: "t-src", text: src ? src.label : "unknown source" }),
        src ? " — " + src.what : ""),
      el("div", {}, "text ", el("span", { class: "t-text", text: visible(tok.text ?? "") }),
        tok.id !== undefined ? "  id " + tok.id : ""),
      el("div", { class: "t-bytes", text: "bytes " + (Array.isArray(tok.bytes)
        ? (tok.bytes.map((b) => b.toString(16).padStart(2, "0")).join(" ") || "none") : "—") }),
      el("div", { text: "logprob " + (typeof tok.logprob === "number"
        ? tok.logprob.toFixed(3) + " (p " + Math.exp(tok.logprob).toFixed(3) + ")" : "—") }),
      el("div", { text: "grammar allowed " + (tok.allowed === null || tok.allowed === undefined
        ? "any token (unconstrained)" : tok.allowed + (tok.allowed === 1 ? " token" : " tokens")) }),
    ];
    if (Array.isArray(tok.top) && tok.top.length) {
      rows.push(el("table", {},
        el("thead", {}, el("tr", {}, el("th", { text: "alternative" }), el("th", { text: "id" }), el("th", { text: "logprob" }))),
        el("tbody", {}, ...tok.top.map((a) => el("tr", {},
          el("td", { class: "mono", text: visible(a.text ?? ""),
            title: Array.isArray(a.bytes) ? "bytes " + a.bytes.map((b) => b.toString(16).padStart(2, "0")).join(" ") : "" }),
          el("td", { text: String(a.id ?? "") }),
          el("td", { text: typeof a.logprob === "number" ? a.logprob.toFixed(3) : "—" }))))));
    }
    tip.replaceChildren(...rows);
    tip.dataset.source = tok.source || "unknown";
    tip.hidden = false;
    const r = span.getBoundingClientRect();
    const w = tip.offsetWidth;
    const left = Math.min(Math.max(4, r.left + scrollX), scrollX + document.documentElement.clientWidth - w - 8);
    tip.style.left = left + "px";
    tip.style.top = (r.bottom + scrollY + 6) + "px";
    if (tipFor && tipFor !== span) tipFor.removeAttribute("aria-describedby");
    span.setAttribute("aria-describedby", "token-tip");
    tipFor = span;
  }
  function hideTip() {
    $("token-tip").hidden = true;
    if (tipFor) tipFor.removeAttribute("aria-describedby");
    tipFor = null;
  }

  // -- the server panel (/metrics) -------------------------------------------------------------
  const metrics = { prev: null, samples: [], updates: 0, peak: 0 };
  function parseProm(text) {
    const out = {};
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const m = line.match(/^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)/);
      if (!m) continue;
      const labels = {};
      if (m[3]) for (const kv of m[3].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[kv[1]] = kv[2];
      (out[m[1]] = out[m[1]] || []).push({ labels, value: Number(m[4]) });
    }
    return out;
  }
  const one = (m, name) => (m[name] ? m[name].reduce((a, s) => a + s.value, 0) : undefined);

  function drawPlot() {
    const c = $("srv-plot"), dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 300, h = c.clientHeight || 70;
    if (c.width !== Math.round(w * dpr)) { c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const xs = metrics.samples, max = Math.max(1, ...xs) * 1.15;
    g.fillStyle = "#5b6472";
    g.font = "10px system-ui, sans-serif";
    g.fillText(fmt(max / 1.15) + " tok/s", 4, 11);
    if (xs.length < 2) return;
    const step = w / (60 - 1), x0 = w - (xs.length - 1) * step;
    g.beginPath();
    xs.forEach((v, i) => { const x = x0 + i * step, y = h - 2 - (v / max) * (h - 14); i ? g.lineTo(x, y) : g.moveTo(x, y); });
    g.strokeStyle = "#1f5fbf"; g.lineWidth = 1.5; g.stroke();
    g.lineTo(w, h); g.lineTo(x0, h); g.closePath();
    g.fillStyle = "rgba(31,95,191,.12)"; g.fill();
  }

  async function pollMetrics() {
    try {
      const r = await fetch("/metrics", { headers: authHeaders("openai"), cache: "no-store" });
      const now = performance.now();
      if (r.status === 401) {
        authProblem(true);
        $("srv-updated").textContent = "needs the API key";
        return;
      }
      if (!r.ok) { $("srv-updated").textContent = "metrics unavailable (" + r.status + ")"; return; }
      const m = parseProm(await r.text());
      const tokens = one(m, "specdec_completion_tokens_total"), requests = one(m, "specdec_requests_total");
      let tps = null;
      if (metrics.prev && tokens !== undefined) {
        const dt = (now - metrics.prev.t) / 1000;
        tps = dt > 0 ? Math.max(0, tokens - metrics.prev.tokens) / dt : 0;
        metrics.samples.push(tps);
        if (metrics.samples.length > 60) metrics.samples.shift();
        metrics.peak = Math.max(metrics.peak, tps);
      }
      metrics.prev = { t: now, tokens, requests };
      const th = $("srv-throughput");
      th.textContent = tps === null ? "—" : `${fmt(tps)} tok/s (peak ${fmt(metrics.peak)})`;
      th.dataset.tps = tps === null ? "" : String(tps);
      th.dataset.peak = String(metrics.peak);
      $("srv-requests").textContent = requests === undefined ? "—" :
        `${requests} (${one(m, "specdec_completion_tokens_total") ?? 0} tokens out)`;
      $("srv-requests").dataset.count = String(requests ?? "");
      $("srv-active").textContent = one(m, "specdec_active_requests") ?? "—";
      $("srv-queue").textContent = one(m, "specdec_queue_depth") ?? "—";
      const bs = one(m, "specdec_batch_size"), bm = one(m, "specdec_batch_size_mean");
      $("srv-batch").textContent = bs === undefined ? "—" : `${bs} (mean ${fmt(bm, 2)})`;
      $("srv-acceptance").textContent = pct(one(m, "specdec_draft_acceptance_rate"));
      const gg = one(m, "specdec_grammar_cache_grammars"), gb = one(m, "specdec_grammar_cache_bytes");
      $("srv-grammar").textContent = gg === undefined ? "—" : `${gg} grammars, ${bytes(gb)}`;
      let loaded = (m.specdec_model_loaded || []).filter((s) => s.value > 0).map((s) => s.labels.model);
      if (!m.specdec_model_loaded) loaded = [...new Set((m.specdec_grammar_cache_grammars || []).map((s) => s.labels.model))];
      $("srv-models").textContent = loaded.length ? loaded.join(", ") : "—";
      metrics.updates++;
      const u = $("srv-updated");
      u.textContent = `updated ${new Date().toLocaleTimeString()} (#${metrics.updates})`;
      u.dataset.updates = String(metrics.updates);
      drawPlot();
    } catch (e) {
      $("srv-updated").textContent = "metrics unavailable";
    } finally {
      setTimeout(pollMetrics, REFRESH_MS);
    }
  }

  // The model picker from /v1/models; where that fails, a note says so and the picker keeps
  // what it has ("default" at first).
  async function loadModels() {
    const note = $("model-note"), sel = $("model");
    const problem = (what) => {
      if (!sel.options.length) sel.append(el("option", { value: "default", text: "default" }));
      note.textContent = `${what}: sending to “${sel.value || "default"}”.`;
    };
    let r;
    try {
      r = await fetch("/v1/models", { headers: authHeaders("openai"), cache: "no-store" });
    } catch (e) {
      problem("Could not reach the server for the model list (" + describe(e) + ")");
      return;
    }
    if (r.status === 401) { authProblem(true); note.textContent = ""; return; }
    if (!r.ok) {
      let info;
      try { info = errorOf(await r.json()); } catch (e) { info = { message: r.statusText }; }
      problem(`The model list failed (${r.status}${info.message ? ": " + info.message : ""})`);
      return;
    }
    authProblem(false);
    let list;
    try {
      list = (await r.json()).data;
      if (!Array.isArray(list)) throw new Error("no list of models");
    } catch (e) {
      problem("The model list is unreadable (" + describe(e) + ")");
      return;
    }
    note.textContent = "";
    const ids = list.filter((m) => m && typeof m.id === "string");
    if (!ids.length) return;
    const was = sel.value;
    sel.replaceChildren(...ids.map((m) => el("option", { value: m.id,
      text: m.id + (m.loaded === false ? " (not loaded)" : "") })));
    if (ids.some((m) => m.id === was)) sel.value = was;
    checkConstraint();
  }

  // -- wiring ----------------------------------------------------------------------------------
  function init() {
    buildLegend();
    $("api-key").value = state.key;
    const applyKey = () => {
      const key = $("api-key").value.trim();
      if (key === state.key) return;
      state.key = key;
      if (key) sessionStorage.setItem(KEY_STORE, key);
      else sessionStorage.removeItem(KEY_STORE);
      authProblem(false);
      loadModels();
    };
    $("key-form").addEventListener("submit", (e) => { e.preventDefault(); applyKey(); });
    $("api-key").addEventListener("change", applyKey);
    $("constraint").addEventListener("change", fillExamples);
    $("example").addEventListener("change", () => {
      const ex = EXAMPLES[kind()] || [], i = $("example").value;
      if (i === "") return;
      state.texts[kind()] = $("constraint-text").value = ex[Number(i)][1];
      refreshToolChoice();
      checkConstraint();
    });
    $("constraint-text").addEventListener("input", () => {
      state.texts[kind()] = $("constraint-text").value;
      if (kind() === "tools") refreshToolChoice();
      checkConstraint();
    });
    for (const id of ["api", "model", "tool-choice"]) $(id).addEventListener("change", checkConstraint);
    $("spec").addEventListener("change", () => {
      for (const id of ["k", "lookup", "masking", "tree"]) $(id).disabled = !$("spec").checked;
    });
    const form = $("request-form");
    form.addEventListener("submit", (e) => { e.preventDefault(); sendShown(); });
    form.addEventListener("keydown", (e) => {
      if (e.key !== "Enter" || e.isComposing) return;
      if (e.ctrlKey || e.metaKey || (e.target.id === "user" && !e.shiftKey)) {
        e.preventDefault();
        sendShown();
      }
    });
    $("stop").addEventListener("click", () => state.running && state.running.abort());
    $("new-conversation").addEventListener("click", newConversation);
    const tr = $("transcript");
    tr.addEventListener("mouseover", (e) => { const s = e.target.closest(".tok"); if (s) showTip(s); });
    tr.addEventListener("mouseout", (e) => {
      const s = e.target.closest(".tok");
      if (s && s === tipFor && !s.contains(e.relatedTarget) && document.activeElement !== s) hideTip();
    });
    tr.addEventListener("focusin", (e) => { if (e.target.classList.contains("tok")) showTip(e.target); });
    tr.addEventListener("focusout", (e) => { if (e.target === tipFor) hideTip(); });
    document.addEventListener("keydown", (e) => { if (e.key === "Escape") hideTip(); });
    window.addEventListener("scroll", () => { if (tipFor) showTip(tipFor); }, { passive: true });
    document.documentElement.dataset.tokenSources = "on";
    fillExamples();
    loadModels();
    pollMetrics();
    setRunning(false);
  }

  init();
})();
