"""Encoder tests: parity with sentence-transformers, batch independence, splitting, fakes."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oprag_server.models.encoder import (  # noqa: E402
    TransformersEncoder,
    resolve_encoder_path,
)
from oprag_server.models.fakes import HashingEncoder  # noqa: E402

LONG = (
    "Retrieval-augmented generation combines a retriever, which finds passages relevant to a "
    "question in a large corpus, with a generator that writes an answer conditioned on those "
    "passages. The retriever usually embeds the question and every chunk of every document "
    "into the same vector space and returns the nearest chunks by cosine similarity; a lexical "
    "scorer such as BM25 can be fused with the dense score to recover exact keyword matches. "
    "Chunking matters: chunks that are too long dilute the embedding, chunks that are too short "
    "lose context, and the encoder silently truncates anything beyond its maximum sequence "
    "length, which is why an ingest pipeline must split long inputs before embedding them. "
    "Finally, batching several questions together amortises the cost of the forward pass, but "
    "only if every question's answer is identical to what it would have been on its own, so "
    "batch independence is a correctness property, not an optimisation detail."
)

TEXTS = [
    "hello",
    "What is the capital of France?",
    LONG,
    "Ünïcödé naïve café — 日本語のテキスト, emoji 🚀🔥 and Ελληνικά.",
    "",
    "   leading and trailing whitespace\n\t ",
    "x" * 40,
]


@pytest.fixture(scope="module")
def encoder() -> TransformersEncoder:
    enc = TransformersEncoder("minilm", device="cpu", batch_size=32)
    enc.warm_up()
    return enc


@pytest.fixture(scope="module")
def st_model():
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(resolve_encoder_path("minilm")), device="cpu")


def test_attributes(encoder: TransformersEncoder) -> None:
    assert encoder.name == "minilm"
    assert encoder.dim == 384
    assert encoder.max_tokens == 256
    lengths = encoder.token_lengths(TEXTS)
    assert 180 <= lengths[2] <= 256  # the long text is long but fits
    assert lengths[4] == 2  # [CLS] [SEP]
    assert encoder.tokenize(["hello"])[0][0] == 101 and encoder.tokenize(["hello"])[0][-1] == 102


def test_resolve_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown encoder"):
        resolve_encoder_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="config.json"):
        resolve_encoder_path(str(tmp_path))
    with pytest.raises(ValueError):
        TransformersEncoder(batch_size=0)


def test_parity_with_sentence_transformers(encoder, st_model) -> None:
    ours = encoder.encode(TEXTS)
    ref = st_model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.dtype == np.float32
    assert ours.shape == (len(TEXTS), 384)
    assert np.abs(ours - ref).max() <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_truncate_matches_sentence_transformers(encoder, st_model) -> None:
    over = " ".join([LONG] * 3)
    assert encoder.token_lengths([over])[0] > encoder.max_tokens
    ours = encoder.encode([over, "short"], truncate=True)
    ref = st_model.encode([over, "short"], normalize_embeddings=True, convert_to_numpy=True)
    assert np.abs(ours - ref).max() <= 1e-5


def test_over_limit_raises_with_index(encoder) -> None:
    over = " ".join([LONG] * 3)
    with pytest.raises(ValueError, match=r"text 1 has \d+ tokens"):
        encoder.encode(["fine", over, "fine too"])


def test_batch_independence(encoder) -> None:
    rng = random.Random(7)
    others = [LONG, "tiny", "a b c d e f g", TEXTS[3], LONG[:300], "x" * 40]
    for i, text in enumerate(TEXTS):
        alone = encoder.encode([text])[0]
        for trial in range(3):
            batch = rng.sample(others, k=rng.randint(1, len(others)))
            pos = rng.randint(0, len(batch))
            batch.insert(pos, text)
            got = encoder.encode(batch)[pos]
            diff = float(np.abs(got - alone).max())
            assert diff <= 1e-6, (i, trial, diff)


QUESTION = "What is the capital of France and why is it there?"
MATES = ["hi", "a b", "capital", "one two three four five six seven eight nine ten eleven",
         "why is the sky blue on a clear day", LONG[:400], LONG, "x " * 60, TEXTS[3],
         "Paris France capital city history of the Seine", "z", LONG[:120], "two words"]


def test_query_vector_bit_identical_alone_or_batched(encoder) -> None:
    """A question's vector has the same bytes alone and in batches of 2, 3, 5, 8, 13 with
    shorter and longer questions, wherever it sits in the batch (CPU float32 default path)."""
    assert encoder.attn_implementation == "oprag_rowwise" and encoder.batch_invariant
    alone = encoder.encode([QUESTION], truncate=True)[0].tobytes()
    rng = random.Random(3)
    for n in (2, 3, 5, 8, 13):
        for trial in range(3):
            batch = rng.sample(MATES, k=n - 1)
            pos = rng.randint(0, n - 1)
            batch.insert(pos, QUESTION)
            got = encoder.encode(batch, truncate=True)[pos]
            assert got.tobytes() == alone, (n, trial, float(np.abs(got - np.frombuffer(alone, np.float32)).max()))


def test_chunk_vectors_bit_identical_alone_or_batched(encoder) -> None:
    """Ingest path (token ids): a chunk's vector does not depend on its batch mates, so re-ingesting
    a document gives the same stored vectors; also across batch_size cuts."""
    ids = encoder.tokenize(MATES + [QUESTION])
    alone = [encoder.encode_tokenized([x])[0].tobytes() for x in ids]
    for order in (list(range(len(ids))), list(reversed(range(len(ids))))):
        got = encoder.encode_tokenized([ids[i] for i in order])
        assert [got[k].tobytes() for k in range(len(order))] == [alone[i] for i in order]
    small = TransformersEncoder("minilm", device="cpu", batch_size=3)
    assert [v.tobytes() for v in small.encode_tokenized(ids)] == alone


def test_order_restored_across_buckets(encoder) -> None:
    small = TransformersEncoder("minilm", device="cpu", batch_size=2)
    texts = [LONG, "one", LONG[:200], "two words", TEXTS[3], LONG[:50], "z"]
    ref = np.stack([encoder.encode([t])[0] for t in texts])
    got = small.encode(texts)
    assert np.abs(got - ref).max() <= 1e-6
    # each row is closest to its own reference row
    assert (np.argmax(got @ ref.T, axis=1) == np.arange(len(texts))).all()


def test_tokenize_then_encode_tokenized(encoder) -> None:
    ids = encoder.tokenize(TEXTS)
    assert [len(x) for x in ids] == encoder.token_lengths(TEXTS)
    np.testing.assert_array_equal(encoder.encode_tokenized(ids), encoder.encode(TEXTS))
    assert encoder.encode([]).shape == (0, 384)


def test_split_to_fit_long_text(encoder) -> None:
    rng = random.Random(0)
    vocab = LONG.split() + ["naïve", "日本語", "🚀", "antidisestablishmentarianism", "x1y2z3"]
    text = " ".join(rng.choice(vocab) for _ in range(2000))
    pieces = encoder.split_to_fit(text)
    assert len(pieces) > 1
    assert "".join(pieces) == text
    assert all(pieces)
    assert max(encoder.token_lengths(pieces)) <= encoder.max_tokens
    encoder.encode(pieces)  # all fit: must not raise


def test_split_to_fit_no_spaces_and_short(encoder) -> None:
    text = "abcdefghij" * 300  # one giant "word": cuts must fall inside it
    pieces = encoder.split_to_fit(text)
    assert "".join(pieces) == text and all(pieces)
    assert max(encoder.token_lengths(pieces)) <= encoder.max_tokens
    assert encoder.split_to_fit("short text") == ["short text"]


def test_hashing_encoder() -> None:
    a, b = HashingEncoder(dim=64), HashingEncoder(dim=64)
    texts = ["hello world", "Hello, world!", "something else entirely", ""]
    va, vb = a.encode(texts), b.encode(texts)
    assert va.dtype == np.float32 and va.shape == (4, 64)
    np.testing.assert_array_equal(va, vb)
    np.testing.assert_allclose(np.linalg.norm(va, axis=1), 1.0, atol=1e-6)
    assert float(va[0] @ va[1]) > float(va[0] @ va[2])
    np.testing.assert_array_equal(a.encode([texts[2]])[0], va[2])
    small = HashingEncoder(dim=16, max_tokens=10)
    long_text = " ".join(f"w{i}" for i in range(50))
    with pytest.raises(ValueError, match="text 0"):
        small.encode([long_text])
    pieces = small.split_to_fit(long_text)
    assert "".join(pieces) == long_text and max(small.token_lengths(pieces)) <= 10


@pytest.mark.slow  # ~45 s a first run (torch.compile, cold inductor cache; each clean clone): in `make test-all`
def test_compiled_path_matches_eager_and_compiles_at_warm_up():
    """``compile=True``: every bucket is compiled by warm_up; vectors equal the eager ones."""

    class OneBucket(TransformersEncoder):
        BUCKETS = (32,)  # one graph (max_tokens 32): keeps the compile to seconds

    texts = ["What is the capital of France?", "hello", "batch independence is a correctness property"]
    eager = TransformersEncoder("minilm", device="cpu", batch_size=4, max_tokens=32)
    comp = OneBucket("minilm", device="cpu", batch_size=4, max_tokens=32, compile=True)
    comp.warm_up()
    assert comp.last_padded_tokens == 4 * 32  # warm-up ran the fixed-shape forward once
    got = comp.encode(texts)
    assert comp.last_padded_tokens == 4 * 32  # 3 texts padded to 4 rows x the 32-token bucket
    np.testing.assert_allclose(got, eager.encode(texts), atol=1e-5)


def test_dtype_choice(encoder, st_model) -> None:
    """dtype="auto" is float32 on CPU; bfloat16 vectors stay float32 and close to the reference."""
    assert encoder.dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        TransformersEncoder("minilm", dtype="int8")
    bf = TransformersEncoder("minilm", device="cpu", dtype="bfloat16")
    ours = bf.encode(TEXTS)
    assert bf.dtype == "bfloat16" and ours.dtype == np.float32
    ref = st_model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    cos = (ours * ref).sum(axis=1)
    assert cos.min() > 0.99  # bfloat16 rounding only
    assert np.abs(ours - ref).max() > 1e-6  # it really ran in bfloat16
