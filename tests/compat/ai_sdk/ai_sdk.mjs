// The Vercel AI SDK's default OpenAI provider against the gateway: `openai(model)` calls
// POST /v1/responses. Prints one JSON object with what each call returned.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

const openai = createOpenAI({
  baseURL: process.env.GATEWAY_BASE_URL,
  apiKey: process.env.GATEWAY_API_KEY,
});
const model = openai(process.env.GATEWAY_MODEL);
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
// The gateway stores no responses: with the SDK's default (store unset, so true) a step
// after one with text refers to that text by id; with store: false it sends it again.
const withTools = await generateText({
  model,
  prompt: "What is the weather in Paris?",
  tools: { get_weather: weather },
  stopWhen: stepCountIs(2),
  providerOptions: { openai: { store: false } },
});
let referenced = null;
try {
  await generateText({
    model,
    prompt: "What is the weather in Paris?",
    tools: { get_weather: weather },
    stopWhen: stepCountIs(2),
  });
} catch (error) {
  referenced = { status: error.statusCode ?? error.lastError?.statusCode, message: error.message };
}

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
    referenced,
    broken: { chunks: brokenChunks, errors: failed },
  }),
);
