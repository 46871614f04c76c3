import os
import socket
import subprocess
import sys
from pathlib import Path

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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "fake-server", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        env = {
            **os.environ,
            "EMBEDDINGS_BASE_URL": f"http://127.0.0.1:{port}/v1",
            "EMBEDDINGS_MODEL": "fake-embedder",
        }
        out = run(env)
        assert "embedding model 'fake-embedder'" in out
        assert out.count("  -> [") == 4
    finally:
        server.terminate()
        server.wait(timeout=10)
