// The official `openai` npm client (not written here) against a live kvserve router or node:
// models, completions and chat, whole and streamed, usage, and errors, checked against the text
// `kvserve generate` gives for the same prompt (greedy). Run by tests/tools/serve_cli_test.cc:
//   node tests/npm/openai_client.mjs BASE_URL EXPECTED.json
// EXPECTED.json: {"model": ..., "prompt": ..., "max_tokens": N, "text": <local continuation>}.
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';

const [base, expectedPath] = process.argv.slice(2);
const want = JSON.parse(readFileSync(expectedPath, 'utf8'));
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'kvserve-needs-no-key', maxRetries: 0, timeout: 60_000 });
let checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) {
    console.error(`FAILED: ${what}`);
    process.exit(1);
  }
}

const models = await client.models.list();
check(models.data.length === 1 && models.data[0].id === want.model, `models.list: ${JSON.stringify(models.data)}`);

const whole = await client.completions.create({ model: want.model, prompt: want.prompt, max_tokens: want.max_tokens, temperature: 0 });
check(whole.choices[0].text === want.text, `completion text ${JSON.stringify(whole.choices[0].text)} != ${JSON.stringify(want.text)}`);
check(whole.choices[0].finish_reason === 'length', `finish_reason ${whole.choices[0].finish_reason}`);
check(whole.usage.completion_tokens === want.max_tokens, `usage ${JSON.stringify(whole.usage)}`);

let streamed = '';
let usage = null;
let finish = null;
const stream = await client.completions.create({
  model: want.model, prompt: want.prompt, max_tokens: want.max_tokens, temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  const c = chunk.choices[0];
  if (c) {
    streamed += c.text ?? '';
    if (c.finish_reason) finish = c.finish_reason;
  }
}
check(streamed === want.text, `streamed text ${JSON.stringify(streamed)} != ${JSON.stringify(want.text)}`);
check(finish === 'length' && usage && usage.completion_tokens === want.max_tokens, `stream end: ${finish} ${JSON.stringify(usage)}`);

const messages = [{ role: 'system', content: 'You tell stories.' }, { role: 'user', content: 'Tell me about a cat.' }];
const chat = await client.chat.completions.create({ model: want.model, messages, max_tokens: 12, temperature: 0 });
const chatText = chat.choices[0].message.content;
check(chat.choices[0].message.role === 'assistant' && typeof chatText === 'string' && chatText.length > 0, `chat ${JSON.stringify(chat.choices[0])}`);
let chatStreamed = '';
for await (const chunk of await client.chat.completions.create({ model: want.model, messages, max_tokens: 12, temperature: 0, stream: true })) {
  chatStreamed += chunk.choices[0]?.delta?.content ?? '';
}
check(chatStreamed === chatText, `streamed chat ${JSON.stringify(chatStreamed)} != ${JSON.stringify(chatText)}`);

async function refused(body, status, param) {
  try {
    await client.completions.create(body);
  } catch (e) {
    check(e instanceof OpenAI.APIError && e.status === status, `${JSON.stringify(body)}: ${e.status} ${e.message}`);
    check(e.param === param || e.error?.param === param, `${JSON.stringify(body)}: param ${e.param ?? e.error?.param}`);
    return;
  }
  check(false, `${JSON.stringify(body)} was answered`);
}
await refused({ model: 'gpt-4', prompt: 'x' }, 404, 'model');
await refused({ model: want.model, prompt: 'x', max_tokens: 0 }, 400, 'max_tokens');
await refused({ model: want.model, prompt: 'x', temperature: 3 }, 400, 'temperature');
await refused({ model: want.model, prompt: 'x', n: 2 }, 400, 'n');

console.log(`openai client ${OpenAI.VERSION ?? ''}: ${checks} checks passed`);
