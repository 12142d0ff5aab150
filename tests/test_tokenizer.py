"""The embedded SmolLM2 tokenizer built from GGUF metadata: fixed ids, digits, specials."""
from __future__ import annotations

import os

import pytest

from paged.models import embedded_gguf_path
from paged.models.gguf_loader import open_gguf
from paged.models.tokenizer import tokenizer_from_gguf

# ids verified against transformers' GGUF tokenizer (plain ASCII, no digits) and by hand
# for the digit split (llama.cpp's `smollm` pre-tokenizer: every digit is its own piece).
FIXED = {
    "Hello world! The quick brown fox.": [19556, 905, 17, 378, 2365, 6354, 16438, 30],
    "In 2024, 12 cats ate 345 fish.":
        [788, 216, 34, 32, 34, 36, 28, 216, 33, 34, 7680, 15563, 216, 35, 36, 37, 2698, 30],
    "<|im_start|>user\nHi<|im_end|>": [1, 4093, 198, 26843, 2],
    " leading space": [2899, 1898],
    "x 2024 y12": [104, 216, 34, 32, 34, 36, 329, 33, 34],
}
PLAIN = """The workbench keeps every block of the key-value cache in a pool. When a request arrives,
the scheduler asks the manager for free blocks; if none are left, it preempts the newest request.
  Indented lines,   runs of spaces,\ttabs, "quotes", 'apostrophes' -- and punctuation!?
Don't forget: you'll see it's done. Ünïcödé wörds."""


@pytest.fixture(scope="module")
def tok():
    return tokenizer_from_gguf(open_gguf(embedded_gguf_path()))


def test_fixed_ids_and_round_trip(tok):
    for text, ids in FIXED.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.vocab_size == 49152
    assert tok.decode([1, 4093, 198, 26843, 2]) == "user\nHi"  # specials skipped by default


def test_digits_are_split_individually(tok):
    ids = tok.encode("9876543210")
    assert len(ids) == 10
    assert [tok.decode([i]) for i in ids] == list("9876543210")


def test_matches_transformers_on_plain_ascii_text(tok):
    transformers = pytest.importorskip("transformers")
    p = embedded_gguf_path()
    try:
        ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))
    except Exception as e:  # noqa: BLE001 - an optional oracle
        pytest.skip(f"transformers cannot read the GGUF tokenizer: {e}")
    assert tok.encode(PLAIN) == ref.encode(PLAIN, add_special_tokens=False)


def test_hf_directory_tokenizer_json(tmp_path, tok):
    """A HF directory with tokenizer.json: string prompts in, text out."""
    pytest.importorskip("transformers")
    from paged.engine.llm import LLM
    from paged.models.testing import make_tiny_checkpoint
    from paged.engine.sampling import SamplingParams
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=tok.vocab_size, hidden_size=32,
                                intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(path, num_blocks=16, block_size=8)
    assert llm.tokenizer.encode("In 2024, 12 cats ate 345 fish.") == FIXED["In 2024, 12 cats ate 345 fish."]
    out = llm.generate("Hello world!", SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.prompt_token_ids == [19556, 905, 17]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_importable_on_its_own():
    """``paged.models.tokenizer`` imported first (before ``paged.models``) was a circular ImportError."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "from paged.models.tokenizer import Tokenizer"],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-2000:]


def test_user_defined_tokens_decode_as_text():
    """GGUF user-defined tokens (type 4) are text: skip_special_tokens drops control tokens only."""
    from tokenizers import pre_tokenizers

    class Field:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    class Reader:
        pass

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<|ctl|>", "<user_def>"]
    reader = Reader()
    reader.fields = {k: Field(v) for k, v in {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [1] * len(alphabet) + [3, 4]}.items()}
    t = tokenizer_from_gguf(reader)
    ids = t.encode("hi<user_def> x<|ctl|>")
    assert ids[2] == len(alphabet) + 1 and ids[-1] == len(alphabet)  # each one token
    assert t.decode(ids) == "hi<user_def> x"
    assert t.decode(ids, skip_special_tokens=False) == "hi<user_def> x<|ctl|>"
