"""The OpenAI-compatible server against the official `openai` client, on 127.0.0.1 and a
free port, one server process for the module (SIGTERM at the end must exit 0). Greedy
answers must equal the offline LLM's for the same prompts; streamed text must equal the
non-streamed text; a client that goes away must get its pages freed."""
import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from experiments.common import ROOT, post_raw, read_response
from jaxinfer.config import SamplingParams

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
KEY = "test-key"
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512, num_pages=512)
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
             "Say hello in Spanish."]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _get(url, timeout=5.0) -> str:
  with urllib.request.urlopen(url, timeout=timeout) as r:
    return r.read().decode()


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory):
  """A LoRA adapter "upper" (random, rank 4, q/v/down) that the server serves by name."""
  from jaxinfer.lora import save_peft
  from jaxinfer.lora.adapter import random_adapter_factors
  path = str(tmp_path_factory.mktemp("lora") / "upper")
  a, b = random_adapter_factors(smollm2.cfg, 4, ("wq", "wv", "w_down"), seed=5)
  save_peft(path, a, b, smollm2.cfg, rank=4, alpha=8)
  return path


@pytest.fixture(scope="module")
def server(adapter):
  port = _free_port()
  args = [sys.executable, "-m", "jaxinfer", "serve", f"--port={port}", f"--api_key={KEY}",
          "--warmup=false", "--max_queue=64", f"--lora=upper={adapter}",
          "--max_body_bytes=1000000", "--max_prompt_chars=20000", "--drain_timeout_s=3"] + [
              f"--{k}={v}" for k, v in ENGINE.items()]
  proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  base = f"http://127.0.0.1:{port}"
  try:
    for _ in range(240):  # bounded: the model loads in ~10 s
      if proc.poll() is not None:
        raise AssertionError(f"server exited {proc.returncode}: {proc.stdout.read()}")
      with contextlib.suppress(OSError):
        if '"ok"' in _get(base + "/health", 1.0):
          break
      time.sleep(0.5)
    else:
      raise AssertionError("server did not come up in 120 s")
    yield base, proc
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(60)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def offline(smollm2, adapter):
  from jaxinfer.llm import LLM
  return LLM(smollm2, warmup=False, lora_adapters={"upper": adapter}, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _metric(base, name, **labels) -> float:
  text = _get(base + "/metrics")
  for line in text.splitlines():
    if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
      return float(line.rsplit(" ", 1)[1])
  return 0.0


def test_chat_and_completions_equal_offline_greedy(client, offline):
  sp = SamplingParams(max_tokens=24)
  msgs = [{"role": "system", "content": "Answer in one short sentence."},
          {"role": "user", "content": QUESTIONS[0]}]
  want = offline.chat([msgs], sp)[0]
  got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                       temperature=0)
  assert got.choices[0].message.content == want.text
  assert got.choices[0].finish_reason == want.finish_reason
  assert got.usage.completion_tokens == len(want.token_ids)
  assert got.usage.prompt_tokens == len(want.prompt_token_ids)
  chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == want.text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
  assert chunks[-1].usage.completion_tokens == len(want.token_ids)

  prompt = "The three largest planets of the solar system are"
  want = offline.generate(prompt, SamplingParams(max_tokens=16))[0]
  got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  logprobs=0)
  assert got.choices[0].text == want.text
  lps = got.choices[0].logprobs.token_logprobs
  assert lps == pytest.approx(want.logprobs, abs=1e-3)
  streamed = "".join(c.choices[0].text for c in client.completions.create(
      model=MODEL, prompt=want.prompt_token_ids, max_tokens=16, temperature=0, stream=True))
  assert streamed == want.text


def test_stop_strings_cut_streamed_and_whole_text_alike(client, offline):
  msgs = [{"role": "user", "content": QUESTIONS[0]}]
  full = offline.chat([msgs], SamplingParams(max_tokens=24))[0].text
  word = re.findall(r"[A-Za-z]{4,}", full)[1]  # a word inside the answer
  expect = full[:full.index(word)]
  got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                       temperature=0, stop=[word])
  assert got.choices[0].message.content == expect
  assert got.choices[0].finish_reason == "stop"
  chunks = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                          temperature=0, stop=[word], stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expect


def test_n_choices_with_a_seed_repeat_exactly(client):
  kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2,
            seed=1234)
  a = client.completions.create(**kw)
  b = client.completions.create(**kw)
  assert [c.index for c in a.choices] == [0, 1]
  assert [c.text for c in a.choices] == [c.text for c in b.choices]
  assert 2 <= a.usage.completion_tokens <= 24
  c = client.completions.create(**{**kw, "seed": 99})
  assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_sixteen_concurrent_streams_are_all_correct(server, offline):
  prompts = [[{"role": "user", "content": QUESTIONS[i % 4] + " " * (i // 4)}]
             for i in range(16)]
  want = [o.text for o in offline.chat(prompts, SamplingParams(max_tokens=16))]
  aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0,
                               timeout=300)

  async def one(msgs):
    s = await aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                              temperature=0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

  async def all_of():
    try:
      return await asyncio.gather(*(one(m) for m in prompts))
    finally:
      await aclient.close()

  assert asyncio.run(all_of()) == want


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server, client, offline):
  base = server[0]
  aborted = _metric(base, "jaxinfer:request_success_total", finished_reason="abort")
  s = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=400,
                                temperature=0, stream=True, extra_body={"ignore_eos": True})
  it = iter(s)
  for _ in range(3):
    next(it)
  assert _metric(base, "jaxinfer:kv_pages_used") > 0
  s.close()  # the client goes away mid-stream
  for _ in range(100):  # bounded: the abort lands within a few steps
    if _metric(base, "jaxinfer:kv_pages_used") == 0 and _metric(
        base, "jaxinfer:request_success_total", finished_reason="abort") > aborted:
      break
    time.sleep(0.2)
  else:
    raise AssertionError("pages not freed 20 s after the client disconnected")
  # all of the pool: what the LoRA slot left of num_pages (the same as the offline LLM's)
  assert offline.executor.num_pages < ENGINE["num_pages"]
  assert _metric(base, "jaxinfer:kv_pages_free") == offline.executor.num_pages


@pytest.mark.parametrize("kw, param, words", [
    (dict(temperature=5), "temperature", "above the maximum 2.0"),
    (dict(max_tokens=0), "max_tokens", "below the minimum 1"),
    (dict(max_tokens=10_000), "max_tokens", "above the maximum 512"),
    (dict(top_p=0), "top_p", "must be > 0"),
    (dict(presence_penalty=2.5), "presence_penalty", "above the maximum 2.0"),
    (dict(logprobs=21), "logprobs", "above the maximum 20"),
    (dict(logit_bias={"x": 1}), "logit_bias", "not a token id"),
    (dict(logit_bias={"5": 200}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={"999999": 1}), "logit_bias", "outside the vocabulary"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens", "above the maximum 4"),
    (dict(echo=True), "echo", "not supported"),
    (dict(n=0), "n", "below the minimum 1"),
])
def test_bad_parameters_are_400_naming_field_value_and_limit(client, kw, param, words):
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=MODEL, prompt="hi", **{"max_tokens": 4, **kw})
  err = e.value.body
  assert err["param"] == param and words in err["message"], err


def test_structured_output_response_format_and_guided_extras(client, offline):
  """response_format json_schema (whole and streamed) equals the offline LLM's
  constrained answer and validates; json_object parses; vLLM's guided_choice and
  guided_regex are followed; a schema that does not compile, or two constraints, is a
  400 naming the field."""
  import json
  schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "population_millions": {"type": "number",
                                                                     "minimum": 0}},
            "required": ["city", "population_millions"], "additionalProperties": False}
  msgs = [{"role": "user", "content": "Which is the largest city of Japan?"}]
  want = offline.chat([msgs], SamplingParams(max_tokens=60, json_schema=schema))[0]
  rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
  got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                       temperature=0, response_format=rf)
  text = got.choices[0].message.content
  assert text == want.text and got.choices[0].finish_reason == "stop"
  obj = json.loads(text)
  assert set(obj) == {"city", "population_millions"} and obj["population_millions"] >= 0
  chunks = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                          temperature=0, response_format=rf, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
  got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                       temperature=0, response_format={"type": "json_object"})
  assert isinstance(json.loads(got.choices[0].message.content), dict)
  got = client.completions.create(model=MODEL, prompt="Is ice cold? Answer:", max_tokens=5,
                                  temperature=0.7, n=3,
                                  extra_body={"guided_choice": ["yes", "no"]})
  assert {c.text for c in got.choices} <= {"yes", "no"}
  many = [f"option {i}" for i in range(2500)]  # more choices than a parser row holds
  got = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": many})
  assert got.choices[0].text in many and got.choices[0].finish_reason == "stop"
  got = client.completions.create(model=MODEL, prompt="A date:", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
  assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", got.choices[0].text)
  bad_rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
      "type": "object", "properties": {"a": {"type": "strin"}}}}}
  for kw, param, words in [
      (dict(response_format=bad_rf), "response_format", "invalid json_schema"),
      (dict(response_format={"type": "xml"}), "response_format", "must be"),
      (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
       "guided_regex", "at most one"),
      (dict(extra_body={"guided_regex": "a("}), "guided_regex", "invalid regex"),
      (dict(extra_body={"guided_regex": r"[^\s\S]"}), "guided_regex", "admits no string"),
      (dict(extra_body={"guided_grammar": "start: " + " | ".join(
          f'"opt{i}"' for i in range(2500))}), "guided_grammar", "max is 2000")]:
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


def test_top_logprobs_penalties_and_min_tokens_equal_offline(client, offline):
  msgs = [{"role": "user", "content": "Name three animals."}]
  sp = SamplingParams(max_tokens=12, logprobs=3, frequency_penalty=0.8, repetition_penalty=1.3,
                      min_tokens=10, logit_bias=((504, -5.0),))
  want = offline.chat([msgs], sp)[0]
  got = client.chat.completions.create(
      model=MODEL, messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
      frequency_penalty=0.8, logit_bias={"504": -5},
      extra_body={"repetition_penalty": 1.3, "min_tokens": 10})
  ch = got.choices[0]
  assert ch.message.content == want.text and len(ch.logprobs.content) == len(want.token_ids)
  for item, alts in zip(ch.logprobs.content, want.top_logprobs):
    assert len(item.top_logprobs) == 3
    assert [a.logprob for a in item.top_logprobs] == pytest.approx([v for _, v in alts],
                                                                  abs=1e-3)
  c = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0,
                                logprobs=2)
  tops = c.choices[0].logprobs.top_logprobs
  assert len(tops) == 4 and all(1 <= len(t) <= 2 for t in tops)


def test_long_prompt_unknown_model_and_wrong_key(server, client):
  with pytest.raises(openai.BadRequestError, match="context window"):
    client.completions.create(model=MODEL, prompt=[1] * 500, max_tokens=20)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
  bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.models.list()
  models = client.models.list().data
  assert [m.id for m in models] == [MODEL, "upper"]
  assert models[1].model_extra["parent"] == MODEL


def test_a_lora_adapter_is_served_by_its_name(client, offline):
  """model=<adapter> runs the request under that adapter (vLLM's convention), streamed
  and not, equal to the offline LLM with SamplingParams(lora=...)."""
  msgs = [{"role": "user", "content": QUESTIONS[1]}]
  want = offline.chat([msgs], SamplingParams(max_tokens=16, lora="upper"))[0]
  base = offline.chat([msgs], SamplingParams(max_tokens=16))[0]
  assert want.token_ids != base.token_ids
  got = client.chat.completions.create(model="upper", messages=msgs, max_tokens=16,
                                       temperature=0)
  assert got.choices[0].message.content == want.text and got.model == "upper"
  streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
      model="upper", messages=msgs, max_tokens=16, temperature=0, stream=True) if c.choices)
  assert streamed == want.text


def _post_raw(base, path, body: bytes, content_length=None):
  return post_raw(base, path, body, KEY, content_length)


def test_oversized_and_deeply_nested_bodies_get_json_errors_early(server, client):
  """A body declared larger than --max_body_bytes is a 413 before any of it is read; a
  prompt over --max_prompt_chars a 400 before it is tokenized; JSON nested 100,000 deep a
  400 (it was a plain-text 500 and a traceback)."""
  import json
  base = server[0]
  with contextlib.closing(_post_raw(base, "/v1/completions", b"", 50_000_000)) as sock:
    status, _, body = read_response(sock)  # the 50 MB are never sent
  assert status == 413 and json.loads(body)["error"]["code"] == "payload_too_large"
  assert "--max_body_bytes" in json.loads(body)["error"]["message"]
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=MODEL, prompt="x" * 20001, max_tokens=2)
  assert e.value.body["param"] == "prompt" and "limit is 20000" in e.value.body["message"]
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "system", "content": "y" * 15000}, {"role": "user", "content": "x" * 5001}])
  assert e.value.body["param"] == "messages" and "--max_prompt_chars" in e.value.body["message"]
  deep = b"[" * 100_000 + b"]" * 100_000
  with contextlib.closing(_post_raw(base, "/v1/chat/completions", deep)) as sock:
    status, head, body = read_response(sock)
  assert status == 400 and "application/json" in head
  assert "nested too deeply" in json.loads(body)["error"]["message"]
  assert '"ok"' in _get(base + "/health")


def test_a_non_streaming_client_that_disconnects_is_aborted(server):
  """Tokens keep coming, so the old check (after 0.25 s without an update) never ran: the
  request ran to max_tokens. Now the disconnect itself aborts it."""
  import json
  base = server[0]
  aborted = _metric(base, "jaxinfer:request_success_total", finished_reason="abort")
  body = json.dumps({"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400,
                     "temperature": 0, "ignore_eos": True}).encode()
  sock = _post_raw(base, "/v1/completions", body)
  for _ in range(200):  # bounded: decoding has started
    if _metric(base, "jaxinfer:kv_pages_used") > 0:
      break
    time.sleep(0.05)
  sock.close()
  for _ in range(100):
    if _metric(base, "jaxinfer:request_success_total", finished_reason="abort") > aborted \
        and _metric(base, "jaxinfer:kv_pages_used") == 0:
      break
    time.sleep(0.2)
  else:
    raise AssertionError("the request was not aborted 20 s after its client went away")


def test_sigterm_drains_every_stream_to_an_end(server):
  """Last in the module: SIGTERM with 20 streams open (16 slots; 4 wait): every stream
  ends with a finish reason or an error event, then [DONE]; none is cut silently; the
  process exits 0 after the 3 s drain."""
  import json
  import threading
  base, proc = server
  body = json.dumps({"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 300,
                     "temperature": 0, "ignore_eos": True, "stream": True}).encode()
  ends = [None] * 20

  def read(i, sock):
    buf, last = b"", None
    with contextlib.suppress(OSError):
      while True:
        got = sock.recv(65536)
        if not got:
          break
        buf += got
        for line in buf.split(b"\n"):
          if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if "error" in event:
              last = "error"
            elif event["choices"] and event["choices"][0].get("finish_reason"):
              last = event["choices"][0]["finish_reason"]
        if b"data: [DONE]" in buf:
          break
    ends[i] = (last, b"data: [DONE]" in buf)

  socks = [_post_raw(base, "/v1/completions", body) for _ in range(20)]
  readers = [threading.Thread(target=read, args=(i, s), daemon=True)
             for i, s in enumerate(socks)]
  for t in readers:
    t.start()
  for _ in range(200):  # bounded: the running ones have started decoding
    if _metric(base, "jaxinfer:kv_pages_used") > 0:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  for t in readers:
    t.join(60)
  assert proc.wait(60) == 0
  assert all(e is not None and e[0] is not None and e[1] for e in ends), ends
