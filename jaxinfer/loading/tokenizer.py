"""Tokenizer built from a GGUF file's own metadata with the `tokenizers` library.

Byte-level BPE ("gpt2" in GGUF terms): the vocabulary, merges and control tokens come
from the file; the pre-tokenizer follows the file's `tokenizer.ggml.pre` the way
llama.cpp does (e.g. "smollm" isolates every digit before the GPT-2 split). The chat
template stored in the file is rendered with jinja2, as transformers renders it.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

from jaxinfer.loading.errors import ModelLoadError

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer types -> the regexes applied in order before byte-level BPE.
_PRE_SPLITS = {
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "qwen2": (_QWEN2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "default": (_GPT2_SPLIT,),
}


class Tokenizer:
  """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`."""

  def __init__(self, backend, *, bos_token_id: Optional[int], eos_token_ids: Sequence[int],
               add_bos: bool, chat_template: Optional[str], special_tokens: Dict[str, int]):
    self.backend = backend
    self.bos_token_id = bos_token_id
    self.eos_token_ids = tuple(eos_token_ids)
    self.add_bos = add_bos
    self.chat_template = chat_template
    self.special_tokens = special_tokens

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if add_special_tokens and self.add_bos and self.bos_token_id is not None:
      ids = [self.bos_token_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: List[dict], add_generation_prompt: bool = True,
                          **kwargs) -> str:
    if not self.chat_template:
      raise ModelLoadError("this model file has no chat template; pass a plain prompt instead")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
      raise jinja2.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    tmpl = env.from_string(self.chat_template)
    inv = {v: k for k, v in self.special_tokens.items()}
    return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=inv.get(self.bos_token_id, ""),
                       eos_token=inv.get(self.eos_token_ids[0], "") if self.eos_token_ids else "",
                       **kwargs)


def _byte_level_bpe(tokens: List[str], merges: List[str], pre: str):
  from tokenizers import Regex, decoders, models, pre_tokenizers
  from tokenizers import Tokenizer as HFTokenizer
  vocab = {t: i for i, t in enumerate(tokens)}
  bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                   fuse_unk=False, byte_fallback=False, ignore_merges=False)
  tk = HFTokenizer(bpe)
  splits = _PRE_SPLITS.get(pre, _PRE_SPLITS["default"])
  tk.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits] +
      [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tk.decoder = decoders.ByteLevel()
  return tk


def tokenizer_from_gguf(reader) -> Tokenizer:
  from tokenizers import AddedToken
  from jaxinfer.loading.gguf_loader import field
  model = field(reader, "tokenizer.ggml.model")
  if model != "gpt2":
    raise ModelLoadError(
        f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
  tokens = list(field(reader, "tokenizer.ggml.tokens"))
  merges = list(field(reader, "tokenizer.ggml.merges", []))
  types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  pre = field(reader, "tokenizer.ggml.pre", "default")
  backend = _byte_level_bpe(tokens, merges, pre)
  special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3}  # CONTROL
  backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
  user = [t for t, ty in zip(tokens, types) if ty == 4]  # USER_DEFINED
  if user:
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
  bos = field(reader, "tokenizer.ggml.bos_token_id")
  eos = field(reader, "tokenizer.ggml.eos_token_id")
  eot = field(reader, "tokenizer.ggml.eot_token_id")
  eos_ids = tuple(dict.fromkeys(int(x) for x in (eot, eos) if x is not None))
  return Tokenizer(backend, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
                   add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=field(reader, "tokenizer.chat_template"), special_tokens=special)


def save_tokenizer(tk: Tokenizer, path: str) -> None:
  """Write `tk` to the directory `path`: tokenizer.json and tokenizer_meta.json (the ids,
  template and special tokens, with tokenizer.json's SHA-256), read by load_saved."""
  import hashlib
  text = tk.backend.to_str()
  with open(os.path.join(path, "tokenizer.json"), "w") as f:
    f.write(text)
  meta = {"bos_token_id": tk.bos_token_id, "eos_token_ids": list(tk.eos_token_ids),
          "add_bos": tk.add_bos, "chat_template": tk.chat_template,
          "special_tokens": tk.special_tokens,
          "sha256": hashlib.sha256(text.encode()).hexdigest()}
  with open(os.path.join(path, "tokenizer_meta.json"), "w") as f:
    json.dump(meta, f)


def load_saved(path: str) -> Tokenizer:
  """The tokenizer save_tokenizer wrote to `path`; ModelLoadError if a file is missing,
  malformed or not the one its meta record hashed."""
  import hashlib
  from tokenizers import Tokenizer as HFTokenizer
  try:
    with open(os.path.join(path, "tokenizer.json")) as f:
      text = f.read()
    with open(os.path.join(path, "tokenizer_meta.json")) as f:
      meta = json.load(f)
    if hashlib.sha256(text.encode()).hexdigest() != meta["sha256"]:
      raise ValueError("tokenizer.json does not match its recorded SHA-256")
    return Tokenizer(HFTokenizer.from_str(text), bos_token_id=meta["bos_token_id"],
                     eos_token_ids=meta["eos_token_ids"], add_bos=meta["add_bos"],
                     chat_template=meta["chat_template"],
                     special_tokens=meta["special_tokens"])
  except Exception as e:  # noqa: BLE001 -- any damage: the caller reads the GGUF again
    raise ModelLoadError(f"no usable saved tokenizer in {path!r} ({e})") from None


def tokenizer_from_hf_dir(path: str, eos_token_ids: Sequence[int],
                          bos_token_id: Optional[int]) -> Tokenizer:
  from tokenizers import Tokenizer as HFTokenizer
  f = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(f):
    raise ModelLoadError(f"no tokenizer.json in {path!r}; the model directory needs one")
  backend = HFTokenizer.from_file(f)
  template = None
  cfg_path = os.path.join(path, "tokenizer_config.json")
  if os.path.isfile(cfg_path):
    with open(cfg_path) as fh:
      template = json.load(fh).get("chat_template")
  special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
  return Tokenizer(backend, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids, add_bos=False,
                   chat_template=template, special_tokens=special)
