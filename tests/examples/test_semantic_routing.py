import os
import subprocess
import sys
from pathlib import Path

from tests.fake_server_process import fake_server_process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "semantic_routing.py"


def run(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_offline_fallback_says_so_and_routes() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDINGS_")}
    out = run(env)
    assert "NOT a semantic model" in out
    assert out.count("  -> [") == 4
    assert "-> [billing route]" in out and "-> [general route]" in out


def test_uses_an_embeddings_endpoint_when_configured() -> None:
    with fake_server_process() as base_url:
        env = {**os.environ, "EMBEDDINGS_BASE_URL": base_url, "EMBEDDINGS_MODEL": "fake-embedder"}
        out = run(env)
    assert "embedding model 'fake-embedder'" in out
    assert out.count("  -> [") == 4
