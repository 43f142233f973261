// Drives the system Chromium (headless, through playwright-core: no browser download) for tests/test_web.py and
// gpt2onnx bench web. One browser serves many pages: it reads one JSON request per line on stdin,
//   {"url": "...", "screenshot": "PATH" | null, "timeout_ms": 120000}
// opens the page in a fresh context, waits until document.body.dataset.done is set ("true" or "error"), and
// answers one JSON line on stdout: done, #output, #error, the data attributes of #stats and #backend, the page's
// text, its console errors and failed requests. The first line it writes is {"ready": true, "version": ...}.
// Usage: node browser.mjs [--webgpu] (env CHROMIUM: the browser binary, default /usr/bin/chromium)
import readline from "node:readline";
import { chromium } from "playwright-core";

const webgpu = process.argv.includes("--webgpu");
// without the background-networking flags Chromium keeps dialling out, which a closed network refuses;
// playwright gives the browser a fresh --user-data-dir of its own (removed when the browser closes)
const args = [
  "--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
  "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions",
  ...(webgpu
    ? ["--enable-unsafe-webgpu", "--enable-features=Vulkan", "--use-angle=swiftshader", "--use-webgpu-adapter=swiftshader"]
    : ["--disable-gpu"]),
];

const write = (value) => process.stdout.write(JSON.stringify(value) + "\n");
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args,
});
const version = browser.version();

async function visit({ url, screenshot = null, timeout_ms = 120000 }) {
  const context = await browser.newContext({ viewport: { width: 900, height: 700 } });
  const page = await context.newPage();
  const consoleErrors = [], failed = [];
  page.on("console", (m) => m.type() === "error" && consoleErrors.push(m.text().slice(0, 500)));
  page.on("pageerror", (e) => consoleErrors.push(String(e).slice(0, 500)));
  page.on("requestfailed", (r) => failed.push(`${r.url()} ${r.failure()?.errorText ?? ""}`));
  page.on("response", (r) => r.status() >= 400 && failed.push(`${r.url()} ${r.status()}`));
  const started = Date.now();
  try {
    await page.goto(url, { waitUntil: "load", timeout: timeout_ms });
    await page.waitForFunction(() => document.body?.dataset.done, null, { timeout: timeout_ms, polling: 100 });
    const result = await page.evaluate(() => ({
      done: document.body.dataset.done,
      output: document.getElementById("output")?.textContent ?? null,
      error: document.getElementById("error")?.textContent ?? null,
      stats: { ...(document.getElementById("stats")?.dataset ?? {}) },
      backend: { ...(document.getElementById("backend")?.dataset ?? {}) },
      backendText: document.getElementById("backend")?.textContent ?? null,
      statsText: document.getElementById("stats")?.textContent ?? null,
      text: document.body.innerText,
      crossOriginIsolated: self.crossOriginIsolated,
      gpu: "gpu" in navigator,
    }));
    if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });
    return { ...result, seconds: (Date.now() - started) / 1000, console: consoleErrors, failed };
  } catch (err) {
    return { done: "timeout", error: String(err).slice(0, 1000), seconds: (Date.now() - started) / 1000,
      console: consoleErrors, failed };
  } finally {
    await context.close();
  }
}

write({ ready: true, version, webgpu });
const lines = readline.createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) continue;
  let request;
  try {
    request = JSON.parse(line);
  } catch (err) {
    write({ done: "bad-request", error: String(err) });
    continue;
  }
  write(await visit(request));
}
await browser.close();
