"""Semantic routing: send each question to the route whose example utterances match it best.

With an OpenAI-compatible embeddings endpoint (set EMBEDDINGS_BASE_URL, EMBEDDINGS_MODEL and,
if needed, EMBEDDINGS_API_KEY; for example a local Ollama with ``nomic-embed-text``) the
routing uses that model. Without one it falls back to the offline HashingEmbeddingGenerator,
which is not a semantic model (it matches spelling, not meaning), and says so.

    python examples/semantic_routing.py
"""

from __future__ import annotations

import asyncio
import os

from middleware.routing import Route, SemanticRoutingChatClient
from pipeline import EmbeddingGenerator
from pipeline.providers import HashingEmbeddingGenerator, OpenAIEmbeddingGenerator
from pipeline.testing import ScriptedChatClient, reply

PROFILES = {
    "billing": ["I was charged twice", "refund my invoice", "update my credit card"],
    "coding": ["my python code raises an exception", "fix this stack trace", "write a unit test"],
    "travel": ["book a flight to Oslo", "hotel near the station", "train times tomorrow"],
}
QUESTIONS = [
    "Why is there a second charge on my invoice?",
    "This Python exception makes no sense to me",
    "Which train goes to Oslo tomorrow morning?",
    "What is the meaning of life?",
]


def embedding_generator() -> tuple[EmbeddingGenerator, str]:
    base_url = os.environ.get("EMBEDDINGS_BASE_URL")
    model = os.environ.get("EMBEDDINGS_MODEL")
    if base_url and model:
        generator = OpenAIEmbeddingGenerator(
            model, base_url=base_url, api_key=os.environ.get("EMBEDDINGS_API_KEY") or "unused"
        )
        return generator, f"embedding model {model!r} at {base_url}"
    return HashingEmbeddingGenerator(), (
        "the offline HashingEmbeddingGenerator (NOT a semantic model: no EMBEDDINGS_BASE_URL "
        "and EMBEDDINGS_MODEL set)"
    )


async def main() -> None:
    generator, description = embedding_generator()
    print(f"embeddings: {description}")
    routes = {name: ScriptedChatClient(reply(f"[{name} route]"), name=name) for name in PROFILES}
    router = SemanticRoutingChatClient(
        generator,
        {Route(name, routes[name]): utterances for name, utterances in PROFILES.items()},
        ScriptedChatClient(reply("[general route]"), name="general"),
        threshold=0.2,
        top_k=3,
        aggregation="max",
    )
    async with router:
        for question in QUESTIONS:
            ranked = await router.explain(question)
            response = await router.get_response(question)
            scores = ", ".join(f"{r.route_name} {r.score:.2f}" for r in ranked)
            print(f"{question!r}\n  -> {response.text}   scores: {scores or '-'}")


if __name__ == "__main__":
    asyncio.run(main())
