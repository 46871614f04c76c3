"""Chaos for tenants sharing a response cache: two gateway replicas whose key lists differ
(a rolling update: one lists key A first, the other key B first) share one redis-server as
their cache, and 1,000 requests are in flight at once, half with each key, asking the same
twenty questions, spread over both replicas, half of them streamed, after each tenant
asked each question once on the replica that lists it first (so entries are there to find).

Every upstream call answers a text of its own, so where an answer came from shows: each key
is only ever served answers its own misses fetched (no answer reaches both keys), and each
key's hits are its own entries, whichever replica stored them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import defaultdict

import httpx
import pytest

from pipeline.config import parse_config
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import running

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

N = 1000
QUESTIONS = 20
KEYS = ("tenant-a-key", "tenant-b-key")


def answer_of(response: httpx.Response, streamed: bool) -> str:
    if not streamed:
        return str(response.json()["choices"][0]["message"]["content"])
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


async def test_1000_requests_of_two_tenants_over_two_replicas_never_cross(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANTS_REDIS", redis_url)
    monkeypatch.setenv("TENANTS_KEYS_ONE", f"{KEYS[0]},{KEYS[1]}")
    monkeypatch.setenv("TENANTS_KEYS_TWO", f"{KEYS[1]},{KEYS[0]}")
    async with FakeOpenAIServer() as upstream:
        # Each upstream call answers its own text (single chunks: a stream is one delta).
        upstream.script(
            *(FakeResponse(text=f"answer-{i}", chunks=[f"answer-{i}"]) for i in range(N))
        )
        # A bound no loaded machine misses (the default, 0.1 s, is production's): a lookup
        # that times out is a miss, which would only make the run slower.
        cache = {
            "store": "redis",
            "redis_url_env": "TENANTS_REDIS",
            "namespace": "tenants-chaos",
            "timeout": 10.0,
        }

        def config(keys_env: str):  # type: ignore[no-untyped-def]
            return parse_config(
                {
                    "routes": {
                        "primary": {
                            "provider": "openai",
                            "model": "m",
                            "base_url": upstream.base_url,
                        }
                    },
                    "cache": cache,
                    "gateway": {"api_keys_env": keys_env, "max_concurrent_per_key": None},
                }
            )

        served: dict[str, set[str]] = defaultdict(set)
        async with contextlib.AsyncExitStack() as stack:
            replicas = [
                await stack.enter_async_context(running(config("TENANTS_KEYS_ONE"))),
                await stack.enter_async_context(running(config("TENANTS_KEYS_TWO"))),
            ]
            limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:

                async def ask(n: int) -> tuple[str, str, str]:
                    key, replica = KEYS[n % 2], replicas[(n // 2) % 2]
                    streamed = n % 8 >= 4
                    question = f"question {(n // 4) % QUESTIONS}"
                    response = await client.post(
                        f"{replica.base_url}/chat/completions",
                        json={
                            "model": "primary",
                            "messages": [{"role": "user", "content": question}],
                            "stream": streamed,
                        },
                        headers={"authorization": f"Bearer {key}"},
                    )
                    assert response.status_code == 200, response.text
                    return key, question, answer_of(response, streamed)

                # Warm: A on replica one, B on replica two (each first in that list: the
                # same position), one question at a time per tenant.
                for question in range(QUESTIONS):
                    warm = await asyncio.gather(ask(4 * question), ask(4 * question + 3))
                    for key, _question, answer in warm:
                        served[key].add(answer)
                answers = await asyncio.gather(*(ask(n) for n in range(N)))
                for key, _question, answer in answers:
                    assert answer.startswith("answer-"), answer
                    served[key].add(answer)
    # No answer fetched for one tenant ever reached the other.
    assert served[KEYS[0]] and served[KEYS[1]]
    assert not served[KEYS[0]] & served[KEYS[1]]
    # And the cache served most of the 1,000 from entries either replica stored.
    assert len(upstream.requests) < N // 2
