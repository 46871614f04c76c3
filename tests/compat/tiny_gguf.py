"""A tiny random-weight llama-architecture model in GGUF, written by the tests (no download).

The weights are random (seeded), with one designed channel so greedy decoding is known:
dimension 0 of every token embedding is a large constant that no layer writes to (row 0 of
each ``attn_output`` and ``ffn_down`` is zero), so after the final RMS norm that dimension
is always large and positive. The output head reads only that dimension for `ANSWER_PIECE`
and only the random dimensions for every other token, so the model answers `ANSWER_PIECE`
at every step and never emits end-of-sequence on its own: a response is exactly as long as
its token limit. Under a grammar (a forced tool call) the answer token is not allowed, and
the small random logits of the allowed bytes decide, within the grammar.

The vocabulary is SentencePiece-style ("llama" tokenizer model): ``<unk>``, ``<s>``,
``</s>``, the 256 byte-fallback tokens (so any text tokenizes) and a few word pieces.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# The word the model repeats; SentencePiece marks a leading space with U+2581.
ANSWER_WORD = "ok"
ANSWER_PIECE = "\u2581" + ANSWER_WORD
_WORDS = [ANSWER_PIECE, "\u2581yes", "\u2581no", "\u2581hello", "\u2581world"]

_N_EMBD = 64
_N_HEAD = 4
_N_LAYER = 2
_N_FF = 128
_N_CTX = 512
_BIAS = 30.0  # the constant channel; dominates the RMS norm of the residual stream

# SentencePiece token types (gguf.TokenType values).
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of the tiny SentencePiece vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _WORDS
    scores = [0.0] * (3 + 256) + [-float(i + 1) for i in range(len(_WORDS))]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL] * len(_WORDS)
    return tokens, scores, types


def write_tiny_llama(path: Path, *, seed: int = 1234) -> Path:
    """Write the model to `path` (about 1 MB of float32 weights) and return `path`."""
    import gguf  # the gguf-py package of llama.cpp (the `compat` extra)

    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    answer = tokens.index(ANSWER_PIECE)
    rng = np.random.default_rng(seed)

    def random(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors: dict[str, np.ndarray] = {}
    embedding = random(n_vocab, _N_EMBD, std=1.0)
    embedding[:, 0] = _BIAS
    tensors["token_embd.weight"] = embedding
    for block in range(_N_LAYER):
        prefix = f"blk.{block}."
        attn_output = random(_N_EMBD, _N_EMBD)
        attn_output[0, :] = 0.0  # nothing writes to the constant channel
        ffn_down = random(_N_EMBD, _N_FF)
        ffn_down[0, :] = 0.0
        tensors |= {
            prefix + "attn_norm.weight": np.ones(_N_EMBD, dtype=np.float32),
            prefix + "attn_q.weight": random(_N_EMBD, _N_EMBD),
            prefix + "attn_k.weight": random(_N_EMBD, _N_EMBD),
            prefix + "attn_v.weight": random(_N_EMBD, _N_EMBD),
            prefix + "attn_output.weight": attn_output,
            prefix + "ffn_norm.weight": np.ones(_N_EMBD, dtype=np.float32),
            prefix + "ffn_gate.weight": random(_N_FF, _N_EMBD),
            prefix + "ffn_up.weight": random(_N_FF, _N_EMBD),
            prefix + "ffn_down.weight": ffn_down,
        }
    tensors["output_norm.weight"] = np.ones(_N_EMBD, dtype=np.float32)
    output = random(n_vocab, _N_EMBD)
    output[:, 0] = 0.0  # no other token reads the constant channel...
    output[answer, :] = 0.0
    output[answer, 0] = 1.0  # ...and the answer token reads only it
    tensors["output.weight"] = output

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("chat-pipeline tiny random llama")
    writer.add_context_length(_N_CTX)
    writer.add_embedding_length(_N_EMBD)
    writer.add_block_count(_N_LAYER)
    writer.add_feed_forward_length(_N_FF)
    writer.add_head_count(_N_HEAD)
    writer.add_head_count_kv(_N_HEAD)
    writer.add_rope_dimension_count(_N_EMBD // _N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
