// The playground at `/`: plain browser JavaScript, no build step. Speech streams as raw PCM (s16le, 24 kHz mono)
// and is scheduled buffer by buffer on a Web Audio graph as it arrives; the live tab sends typed text over the
// WebSocket (docs/websocket.md). The API key lives in this page's memory only: it is sent as
// `Authorization: Bearer` on HTTP and as `?api_key=` on the WebSocket, and never stored.
"use strict";

const SAMPLE_RATE = 24000;
const $ = (id) => document.getElementById(id);

// what the browser tests read: samples handed to the audio graph, the last first-audio time, page errors
const state = { scheduledSamples: 0, firstAudioMs: null, uploads: 0, liveDone: 0, words: [], errors: [] };
window.playground = state;
window.addEventListener("error", (e) => state.errors.push(String(e.message)));
window.addEventListener("unhandledrejection", (e) => state.errors.push(String(e.reason)));

let apiKey = "";  // never persisted
$("api-key").addEventListener("input", (e) => { apiKey = e.target.value.trim(); });

function authHeaders(extra = {}) {
  return apiKey ? { ...extra, Authorization: `Bearer ${apiKey}` } : extra;
}

function setStatus(id, text, isError = false) {
  const el = $(id);
  el.textContent = text;
  el.classList.toggle("error", isError);
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error?.message ?? JSON.stringify(body)}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// ------------------------------------------------------------------ audio: PCM chunks onto the graph, in order
class PcmPlayer {
  constructor() {
    this.ctx = null;
    this.nextTime = 0;
    this.sources = new Set();
    this.carry = null;  // an odd byte left over from the last chunk (samples are 2 bytes)
  }

  start() {
    // made (or resumed) on a click: browsers let a page start audio only from a user gesture
    this.ctx ??= new AudioContext({ sampleRate: SAMPLE_RATE });
    if (this.ctx.state === "suspended") this.ctx.resume();
    this.stop();
  }

  push(bytes) {
    if (this.carry !== null) {
      const joined = new Uint8Array(bytes.length + 1);
      joined[0] = this.carry;
      joined.set(bytes, 1);
      bytes = joined;
      this.carry = null;
    }
    if (bytes.length % 2) {
      this.carry = bytes[bytes.length - 1];
      bytes = bytes.subarray(0, bytes.length - 1);
    }
    const n = bytes.length / 2;
    if (!n) return;
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
    const buffer = this.ctx.createBuffer(1, n, SAMPLE_RATE);
    const out = buffer.getChannelData(0);
    for (let i = 0; i < n; i++) out[i] = view.getInt16(2 * i, true) / 32768;
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    // a small lead on the first buffer (and after a gap) so that the next one is scheduled before this ends
    this.nextTime = Math.max(this.nextTime, this.ctx.currentTime + 0.05);
    source.start(this.nextTime);
    this.nextTime += buffer.duration;
    this.sources.add(source);
    source.onended = () => this.sources.delete(source);
    state.scheduledSamples += n;
  }

  stop() {
    for (const s of this.sources) { try { s.stop(); } catch { /* not started yet */ } }
    this.sources.clear();
    this.carry = null;
    this.nextTime = 0;
  }
}

const player = new PcmPlayer();

// ------------------------------------------------------------------ models and voices
let voicesByModel = {};

async function loadModels() {
  try {
    const [models, voices] = await Promise.all([
      fetch("/v1/models", { headers: authHeaders() }), fetch("/v1/audio/voices", { headers: authHeaders() })]);
    if (!models.ok) throw new Error(await errorText(models));
    if (!voices.ok) throw new Error(await errorText(voices));
    const listing = await voices.json();
    voicesByModel = listing.models ?? {};
    const select = $("model");
    const current = select.value;
    select.replaceChildren(...(await models.json()).data.map((m) => new Option(m.id, m.id)));
    if (current) select.value = current;
    fillVoices();
    $("uploaded").replaceChildren(...(listing.uploaded_voices ?? []).map((v) => {
      const li = document.createElement("li");
      li.textContent = v.name + (v.ref_text ? ` — "${v.ref_text}"` : "");
      return li;
    }));
    setStatus("speak-status", "");
  } catch (e) {
    setStatus("speak-status", `cannot list models: ${e.message} (an API key?)`, true);
  }
}

function fillVoices() {
  const select = $("voice");
  const current = select.value;
  const voices = voicesByModel[$("model").value]?.voices ?? [];
  select.replaceChildren(new Option("(default)", ""), ...voices.map((v) => new Option(v, v)));
  if (voices.includes(current)) select.value = current;
  else if (voices.length) select.value = voices[0];
}

$("model").addEventListener("change", fillVoices);
$("api-key").addEventListener("change", loadModels);

function requestFields() {
  const fields = { model: $("model").value, response_format: $("format").value, speed: Number($("speed").value) || 1 };
  if ($("voice").value) fields.voice = $("voice").value;
  if ($("instructions").value.trim()) fields.instructions = $("instructions").value.trim();
  if ($("seed").value !== "") fields.seed = Number($("seed").value);
  if ($("max-frames").value !== "") fields.max_new_tokens = Number($("max-frames").value);
  return fields;
}

// ------------------------------------------------------------------ speak (HTTP)
let speaking = null;  // the AbortController of the request in flight

// word timestamps (docs/serving.md "Word timestamps"): each word with its time as a tooltip and a small label
function showWords(words) {
  const box = $("words");
  for (const w of words) {
    const span = document.createElement("span");
    span.title = `${w.start.toFixed(2)}-${w.end.toFixed(2)} s`;
    span.append(w.word, Object.assign(document.createElement("small"), { textContent: w.start.toFixed(2) }));
    box.append(span);
    state.words.push(w);
  }
  box.hidden = state.words.length === 0;
}

function base64Bytes(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

// an SSE body (`speech.audio.*` events, what a stream with timestamps is): `onEvent` for each event, in order
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const raw of events) {
      const data = raw.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
      if (data) onEvent(JSON.parse(data));
    }
  }
}

const MIME = { wav: "audio/wav", mp3: "audio/mpeg", opus: "audio/ogg", flac: "audio/flac", aac: "audio/aac" };

async function speak() {
  speaking?.abort();
  const controller = (speaking = new AbortController());
  const fields = { ...requestFields(), input: $("text").value };
  const streamed = fields.response_format === "pcm";
  const timed = $("timestamps").checked;  // a stream of SSE events, or a JSON body
  if (streamed) player.start();
  $("player").hidden = true;
  state.words = [];
  $("words").replaceChildren();
  $("words").hidden = true;
  setStatus("speak-status", "waiting for audio...");
  const t0 = performance.now();
  try {
    const response = await fetch("/v1/audio/speech", {
      method: "POST", signal: controller.signal,
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify({ ...fields, stream: streamed, ...(timed ? { timestamps: "word" } : {}) }),
    });
    if (!response.ok) throw new Error(await errorText(response));
    if (!streamed) {  // another format: the whole file, played by the audio element
      let blob;
      if (timed) {
        const body = await response.json();
        blob = new Blob([base64Bytes(body.audio)], { type: MIME[fields.response_format] });
        showWords(body.words);
      } else {
        blob = await response.blob();
      }
      state.firstAudioMs = performance.now() - t0;
      const audio = $("player");
      audio.src = URL.createObjectURL(blob);
      audio.hidden = false;
      audio.play().catch(() => {});
      setStatus("speak-status", `${fields.response_format}: ${(blob.size / 1024).toFixed(1)} KiB in ${state.firstAudioMs.toFixed(0)} ms`);
      return;
    }
    let samples = 0;
    const play = (bytes) => {
      if (!bytes.length) return;
      if (samples === 0) {
        state.firstAudioMs = performance.now() - t0;
        setStatus("speak-status", `first audio in ${state.firstAudioMs.toFixed(0)} ms, playing...`);
      }
      player.push(bytes);
      samples += bytes.length / 2;
    };
    if (timed) {
      await readEvents(response, (event) => {
        if (event.type === "speech.audio.delta") play(base64Bytes(event.audio));
        else if (event.type === "speech.audio.timestamps") showWords(event.words);
        else if (event.type === "speech.audio.error") throw new Error(event.error?.message ?? "the stream failed");
      });
    } else {
      const reader = response.body.getReader();
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        play(value);
      }
    }
    const timedWords = timed ? ` · ${state.words.length} words timed` : "";
    setStatus("speak-status", `first audio in ${state.firstAudioMs.toFixed(0)} ms · ${(samples / SAMPLE_RATE).toFixed(2)} s of audio${timedWords}`);
  } catch (e) {
    if (e.name !== "AbortError") setStatus("speak-status", e.message, true);
  } finally {
    if (speaking === controller) speaking = null;
  }
}

$("speak").addEventListener("click", speak);
$("stop").addEventListener("click", () => { speaking?.abort(); player.stop(); setStatus("speak-status", "stopped"); });

// ------------------------------------------------------------------ live text (WebSocket)
const live = { ws: null, contextId: null, sent: "", serial: 0, started: 0 };

function liveSend(message) {
  if (live.ws?.readyState === WebSocket.OPEN && live.contextId) live.ws.send(JSON.stringify({ ...message, context_id: live.contextId }));
}

function liveConnect() {
  live.ws?.close();
  player.start();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const query = apiKey ? `?api_key=${encodeURIComponent(apiKey)}` : "";
  const ws = (live.ws = new WebSocket(`${scheme}//${location.host}/v1/audio/speech/stream${query}`));
  ws.binaryType = "arraybuffer";
  live.contextId = `ctx${++live.serial}`;
  live.sent = "";
  live.started = 0;
  setStatus("live-status", "connecting...");
  ws.onopen = () => {
    const { response_format: _ignored, ...fields } = requestFields();  // the live tab always plays PCM
    ws.send(JSON.stringify({ type: "open", context_id: live.contextId, ...fields, response_format: "pcm" }));
    sendTyped();
  };
  ws.onmessage = (event) => {
    if (event.data instanceof ArrayBuffer) {  // [n][context id: n bytes][audio]
      const bytes = new Uint8Array(event.data);
      if (live.started && state.firstAudioMs === null) state.firstAudioMs = performance.now() - live.started;
      player.push(bytes.subarray(1 + bytes[0]));
      return;
    }
    const message = JSON.parse(event.data);
    if (message.type === "opened") setStatus("live-status", `open: ${message.model} (${message.request_id})`);
    else if (message.type === "done") {
      state.liveDone += 1;
      setStatus("live-status", `done: ${message.finish_reason}, ${message.audio_seconds} s of audio`);
    } else if (message.type === "error") setStatus("live-status", `${message.status}: ${message.error.message}`, true);
  };
  ws.onclose = (event) => {
    if (live.ws === ws) setStatus("live-status", `closed (${event.code}${event.reason ? ": " + event.reason : ""})`);
  };
}

function sendTyped() {
  const text = $("live-text").value;
  if (!text.startsWith(live.sent)) { live.sent = text; return; }  // an edit behind the cursor: only new text is sent
  const piece = text.slice(live.sent.length);
  if (!piece) return;
  if (!live.started) { live.started = performance.now(); state.firstAudioMs = null; }
  liveSend({ type: "append", text: piece });
  live.sent = text;
}

$("live-start").addEventListener("click", liveConnect);
$("live-text").addEventListener("input", sendTyped);
$("live-flush").addEventListener("click", () => liveSend({ type: "flush" }));
$("live-end").addEventListener("click", () => { sendTyped(); liveSend({ type: "end" }); });

// ------------------------------------------------------------------ voices: upload a file or a recording
let recorded = null;  // a WAV File from the microphone
let recorder = null;

function wavFile(buffer, name) {
  // a browser records webm/ogg; the server reads what libsndfile reads, so the clip goes up as 16-bit PCM WAV
  const pcm = buffer.getChannelData(0);
  const data = new DataView(new ArrayBuffer(44 + pcm.length * 2));
  const text = (offset, s) => [...s].forEach((c, i) => data.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF"); data.setUint32(4, 36 + pcm.length * 2, true); text(8, "WAVE"); text(12, "fmt ");
  data.setUint32(16, 16, true); data.setUint16(20, 1, true); data.setUint16(22, 1, true);
  data.setUint32(24, buffer.sampleRate, true); data.setUint32(28, buffer.sampleRate * 2, true);
  data.setUint16(32, 2, true); data.setUint16(34, 16, true); text(36, "data"); data.setUint32(40, pcm.length * 2, true);
  pcm.forEach((x, i) => data.setInt16(44 + 2 * i, Math.max(-1, Math.min(1, x)) * 32767, true));
  return new File([data], name, { type: "audio/wav" });
}

async function toggleRecording() {
  if (recorder?.state === "recording") { recorder.stop(); return; }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (e) => chunks.push(e.data);
    recorder.onstop = async () => {
      stream.getTracks().forEach((t) => t.stop());
      $("record").textContent = "Record";
      try {
        const blob = new Blob(chunks, { type: recorder.mimeType });
        const ctx = new AudioContext();
        const buffer = await ctx.decodeAudioData(await blob.arrayBuffer());
        ctx.close();
        recorded = wavFile(buffer, "recording.wav");
        setStatus("voice-status", `recorded ${buffer.duration.toFixed(1)} s (${recorder.mimeType || "audio"})`);
      } catch (e) {
        setStatus("voice-status", `cannot read the recording: ${e.message}`, true);
      }
    };
    recorder.start();
    recorded = null;
    $("record").textContent = "Stop recording";
    setStatus("voice-status", "recording...");
  } catch (e) {
    setStatus("voice-status", `microphone: ${e.message}`, true);
  }
}

async function upload() {
  const file = recorded ?? $("voice-file").files[0];
  const name = $("voice-name").value.trim();
  if (!name) return setStatus("voice-status", "name: give the voice a name", true);
  if (!file) return setStatus("voice-status", "audio_sample: choose a file or record one", true);
  const form = new FormData();
  form.append("name", name);
  if ($("voice-text").value.trim()) form.append("ref_text", $("voice-text").value.trim());
  form.append("audio_sample", file, file.name);
  setStatus("voice-status", "uploading...");
  try {
    const response = await fetch("/v1/audio/voices", { method: "POST", body: form, headers: authHeaders() });
    if (!response.ok) throw new Error(await errorText(response));
    state.uploads += 1;
    setStatus("voice-status", `uploaded "${name}"`);
    recorded = null;
    await loadModels();
  } catch (e) {
    setStatus("voice-status", e.message, true);
  }
}

$("record").addEventListener("click", toggleRecording);
$("upload").addEventListener("click", upload);

// ------------------------------------------------------------------ tabs
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
    document.querySelectorAll(".panel").forEach((p) => { p.hidden = p.id !== `tab-${tab.dataset.tab}`; });
  });
}

loadModels();
