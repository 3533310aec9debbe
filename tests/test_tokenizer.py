"""Tokenizer from GGUF metadata against transformers' tokenizer for the same file."""
import os

import pytest

from conftest import requires_hf
from jaxinfer.loading import gguf_loader
from jaxinfer.loading.tokenizer import tokenizer_from_gguf

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnew lines", "<|im_start|>user\nhi<|im_end|>",
         "Ünïcödé — ещё 日本語 🙂", "don't stop; it's 'quoted'"]


@pytest.fixture(scope="module")
def tok(smollm2_path):
  return tokenizer_from_gguf(gguf_loader.open_gguf(smollm2_path))


@pytest.fixture(scope="module")
def hf_tok(smollm2_path):
  from transformers import AutoTokenizer
  d, f = os.path.split(smollm2_path)
  return AutoTokenizer.from_pretrained(d, gguf_file=f)


@requires_hf
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(tok, hf_tok, text):
  ids = tok.encode(text)
  assert ids == hf_tok.encode(text, add_special_tokens=False)
  assert tok.decode(ids, skip_special_tokens=False) == text


@requires_hf
def test_chat_template_matches_hf(tok, hf_tok):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
  for m in (msgs, msgs[1:2]):
    assert tok.apply_chat_template(m) == hf_tok.apply_chat_template(
        m, tokenize=False, add_generation_prompt=True)


def test_digits_split_like_llama_cpp(tok):
  """The file's pre-tokenizer "smollm" isolates every digit (llama.cpp does so; HF's GGUF
  import uses the plain GPT-2 split here, so numbers are the one place they differ)."""
  ids = tok.encode("12345")
  assert len(ids) == 5 and tok.decode(ids) == "12345"


def test_special_tokens_are_whole(tok):
  assert tok.encode("<|im_end|>") == [tok.special_tokens["<|im_end|>"]]
  assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"
