// The Vercel AI SDK's default OpenAI provider against the gateway: `openai(model)` calls
// POST /v1/responses. Prints one JSON object with what each call returned.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

// What the SDK sent: the input item types of each request, in order.
const sent = [];
const openai = createOpenAI({
  baseURL: process.env.GATEWAY_BASE_URL,
  apiKey: process.env.GATEWAY_API_KEY,
  fetch: async (url, init) => {
    const body = JSON.parse(init.body);
    sent.push({
      store: body.store ?? null,
      input: body.input.map((item) => item.type ?? "message"),
    });
    return fetch(url, init);
  },
});
const model = openai(process.env.GATEWAY_MODEL);
// A model id the SDK takes for a reasoning model (its defaults differ: reasoning items).
const reasoningModel = openai(process.env.GATEWAY_REASONING_MODEL);
const usage = (u) => ({
  inputTokens: u.inputTokens,
  outputTokens: u.outputTokens,
  totalTokens: u.totalTokens,
});

const generated = await generateText({ model, prompt: "Say hello." });

const streamed = streamText({ model, prompt: "Say hello." });
const chunks = [];
for await (const chunk of streamed.textStream) {
  chunks.push(chunk);
}

const calls = [];
const weather = tool({
  description: "The weather in a city.",
  inputSchema: jsonSchema({
    type: "object",
    properties: { city: { type: "string" } },
    required: ["city"],
  }),
  execute: async ({ city }) => {
    calls.push(city);
    return `Sunny in ${city}`;
  },
});
// With store: false every step sends the whole conversation again.
const withTools = await generateText({
  model,
  prompt: "What is the weather in Paris?",
  tools: { get_weather: weather },
  stopWhen: stepCountIs(2),
  providerOptions: { openai: { store: false } },
});
// The SDK's defaults (store unset, so true): a step refers to the model's earlier output by
// id (item_reference), which the gateway finds among the responses it stored.
const loop = async (m) => {
  const first = sent.length;
  const result = await generateText({
    model: m,
    prompt: "What is the weather in Paris?",
    tools: { get_weather: weather },
    stopWhen: stepCountIs(2),
  });
  return {
    steps: result.steps.length,
    text: result.text,
    reasoning: result.steps[0].reasoningText ?? null,
    sent: sent.slice(first),
  };
};
const defaults = await loop(model);
const reasoning = await loop(reasoningModel);

const failed = [];
const broken = streamText({
  model,
  prompt: "Say hello.",
  onError: ({ error }) => failed.push(String(error?.message ?? error)),
});
const brokenChunks = [];
for await (const chunk of broken.textStream) {
  brokenChunks.push(chunk);
}

console.log(
  JSON.stringify({
    generated: {
      text: generated.text,
      finishReason: generated.finishReason,
      usage: usage(generated.usage),
    },
    streamed: {
      chunks,
      text: await streamed.text,
      finishReason: await streamed.finishReason,
      usage: usage(await streamed.usage),
    },
    tools: {
      calls,
      steps: withTools.steps.length,
      text: withTools.text,
      usage: usage(withTools.totalUsage),
    },
    defaults,
    reasoning,
    broken: { chunks: brokenChunks, errors: failed },
  }),
);
