"""The server's parts without a model: tensors over JSON, request checks and their messages, the
incremental text of streams, stream rows, the bounded queue, auth and the body limit."""
from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import httpx
import pytest
import torch
from pydantic import ValidationError

from engine.serve import encoding, interp, text
from engine.serve.errors import ServeError, from_validation
from engine.serve.guard import Admission, Guard
from engine.serve.schemas import CaptureSpec, ChatRequest, CompletionRequest
from serve_common import read_body


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("how", encoding.ENCODINGS)
def test_tensor_round_trip_is_exact(dtype, how):
    t = (torch.randn(3, 4, 5) * 100).to(dtype)
    obj = encoding.encode(t, how)
    assert obj["dtype"] == str(dtype).replace("torch.", "") and obj["shape"] == [3, 4, 5]
    back = encoding.decode(obj)
    assert back.dtype == dtype and torch.equal(back, t)


@pytest.mark.parametrize("obj, fragment", [
    ({"dtype": "float32", "shape": [4], "data": "AAAA"}, "holds 3 bytes but shape [4] of float32 needs 16"),
    ({"dtype": "float8", "shape": [1], "data": ""}, "dtype 'float8' is not one of"),
    ({"dtype": "float32", "shape": [-1], "data": ""}, "non-negative ints"),
    ({"dtype": "float32", "shape": [1]}, "has the keys dtype, shape and data"),
    ({"dtype": "float32", "shape": [2], "data": [1.0]}, "data has shape [1] but shape says [2]"),
    ({"dtype": "float32", "shape": [1], "data": "%%%"}, "not valid base64"),
])
def test_tensor_decode_says_what_is_wrong(obj, fragment):
    with pytest.raises(ValueError) as e:
        encoding.decode(obj)
    assert fragment in str(e.value)


def test_steer_values_from_json():
    assert encoding.value_in(2) == 2.0 and encoding.value_in(None) is None
    assert torch.equal(encoding.value_in([[1, 2], [3, 4]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    for bad, fragment in ((True, "not a boolean"), ("x", "got str"), ([1, "a"], "found str"),
                          (encoding.encode(torch.arange(3)), "must be floating point")):
        with pytest.raises(ValueError) as e:
            encoding.value_in(bad)
        assert fragment in str(e.value)


def _error(cls, body) -> ServeError:
    with pytest.raises(ValidationError) as e:
        cls.model_validate(body)
    return from_validation(e.value)


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "x"}, "model", "field required"),
    ({"model": "m", "prompt": "x", "interp": {"captures": ["z.0"]}}, "interp.captures", "unknown field"),
    ({"model": "m", "prompt": "x", "interp": {"capture": ["z.0", "zz.1"]}}, "interp.capture.points[1]",
     "unknown point 'zz'"),
    ({"model": "m", "prompt": "x", "interp": {"capture": {"points": []}}}, "interp.capture", "give points or readouts"),
    ({"model": "m", "prompt": "x", "interp": {"capture": {"points": ["z.0"], "positions": "first"}}},
     "interp.capture.positions", "'first' is not one of"),
    # a JSON list is a range; the error says how explicit positions are written
    ({"model": "m", "prompt": "x", "interp": {"capture": {"points": ["z.0"], "positions": [2, 4, 5]}}},
     "interp.capture.positions", 'a range [start, stop] (null = open), got 3 items; explicit positions are {"at": '),
    ({"model": "m", "prompt": "x", "interp": {"steer": [{"address": "z.0", "op": "add", "value": [1.0]},
                                                        {"address": "resid_post.0", "op": "ablate", "value": 1.0}]}},
     "interp.steer[1]", "takes no value"),
    ({"model": "m", "prompt": "x", "interp": {"steer": [{"address": "z.0", "value": [float("nan")]}]}},
     "interp.steer[0]", "NaN or inf"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop", "non-empty"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo", "not supported"),
    ({"model": "m", "prompt": {"text": "x"}}, "prompt", "prompt must be a string"),
])
def test_request_errors_name_the_field(body, param, fragment):
    err = _error(CompletionRequest, body)
    assert err.status == 400 and err.param == param and err.message.startswith(f"{param}: ")
    assert fragment in err.message, err.message


def test_request_shorthands_and_chat_budget():
    r = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "interp": {"capture": "z.0.head-1",
                                                                                           "steer": []}})
    assert r.prompt == [[1, 2], [3]] and r.interp.capture.points == ["z.0.head-1"]
    assert r.interp.capture.reduction == "none" and r.interp.capture.positions == "all"
    steer = CompletionRequest.model_validate({"model": "m", "prompt": "x", "interp": {"steer": [
        {"address": "resid_post.-1", "op": "scale", "value": 2, "positions": [1, None]}]}}).interp.steer[0].steer
    assert steer.positions == slice(1, None) and float(steer.value) == 2.0
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 3})
    assert chat.max_tokens == 3 and chat.messages[0].text() == "ab"
    err = _error(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert err.param.startswith("messages[0].content")


def _tokenizer():
    from engine.zoo.tokenizer import build_tokenizer
    return build_tokenizer()


@pytest.mark.parametrize("stops", [None, ["fox"], ["o", "lazy dog"]])
def test_stream_text_adds_up_to_the_final_text(stops):
    tok = _tokenizer()
    ids = tok("The quick brown fox jumps over the lazy dog, déjà vu 🦊!")["input_ids"]
    d = text.Detok(tok, stops)
    sent = "".join(d.push(t) for t in ids)
    full = tok.decode(ids, skip_special_tokens=True)
    sent += d.final(full)
    assert sent == text.cut(full, stops)[0]
    assert "\ufffd" not in sent


def test_finish_reasons():
    tok = SimpleNamespace
    res = lambda toks, t: tok(new_tokens=torch.tensor(toks), text=t)  # noqa: E731
    assert text.finish(res([5, 6], "ab"), 2, 3, 256, None, None, 2) == ("ab", "length", None)
    assert text.finish(res([5, 2], "a"), 4, 3, 256, None, None, 2) == ("a", "stop", None)
    assert text.finish(res([5, 2], "a"), 2, 3, 256, None, None, 2, ignore_eos=True) == ("a", "length", None)
    assert text.finish(res([5, 6], "a fox b"), 9, 3, 256, ["fox"], None, 2) == ("a ", "stop", "fox")
    assert text.finish(res([5, 7], "ab"), 9, 3, 256, None, [7], 2) == ("ab", "stop", 7)
    assert text.finish(res([5], "a"), 9, 255, 256, None, None, 2) == ("a", "length", None)


def test_payload_positions_and_reductions():
    cache = {"a": torch.arange(12.0).reshape(6, 2)}
    spec = CaptureSpec(points=["z.0"], positions="last", reduction="none")
    out, n = interp.payload(spec, cache, prompt_len=4, end=6)
    assert out["positions"] == [3, 4, 5] and torch.equal(encoding.decode(out["captures"]["a"]), cache["a"][3:])
    assert n == 3 * 2 * 4
    mean = CaptureSpec(points=["z.0"], positions=[0, 2], reduction="mean")
    out, _ = interp.payload(mean, cache, prompt_len=4, end=6)
    assert torch.equal(encoding.decode(out["captures"]["a"]), cache["a"][:2].mean(0))
    empty = CaptureSpec(points=["z.0"], positions="generated", reduction="last")
    assert interp.payload(empty, {"a": cache["a"][:4]}, prompt_len=4, end=4)[0]["captures"]["a"] is None
    late = interp.payload(spec, {"a": cache["a"], "logits": cache["a"][3:]}, prompt_len=4, end=6)[0]
    assert "positions" not in late["captures"]["a"] and late["captures"]["logits"]["shape"] == [3, 2]
    everything = CaptureSpec(points=["z.0"])
    late = interp.payload(everything, {"a": cache["a"], "logits": cache["a"][3:]}, prompt_len=4, end=6)[0]
    assert late["captures"]["logits"]["positions"] == [3, 4, 5] and late["positions"] == list(range(6))
    with pytest.raises(ServeError) as e:
        interp.payload(spec, cache, prompt_len=4, end=6, budget=interp.Budget(raw=10))
    assert e.value.status == 400 and e.value.param == "interp.capture" and "--max-capture-bytes" in e.value.message


def test_response_budget_counts_encoded_bytes_before_encoding():
    """--max-response-bytes bounds what the encoded captures add to a body (base64 4/3 of raw, a list
    number 25 bytes), refused before encoding; list captures holding inf are a 400 (JSON has no inf)."""
    cache = {"a": torch.arange(12.0).reshape(6, 2)}
    spec = CaptureSpec(points=["z.0"])
    raw = 6 * 2 * 4
    out, _ = interp.payload(spec, cache, 4, 6, budget=interp.Budget(wire=4 * raw // 3))
    assert len(out["captures"]["a"]["data"].value()) == 4 * raw // 3  # the estimate is the encoded length
    with pytest.raises(ServeError) as e:
        interp.payload(spec, cache, 4, 6, budget=interp.Budget(wire=4 * raw // 3 - 1))
    assert e.value.status == 413 and "--max-response-bytes" in e.value.message and e.value.param == "interp.capture"
    listed = CaptureSpec(points=["z.0"], encoding="list")
    out, _ = interp.payload(listed, cache, 4, 6, budget=interp.Budget(wire=12 * interp.Budget.LIST_BYTES))
    assert len(json.dumps(out["captures"]["a"]["data"].value())) <= 12 * interp.Budget.LIST_BYTES
    with pytest.raises(ServeError) as e:
        interp.payload(listed, cache, 4, 6, budget=interp.Budget(wire=12 * interp.Budget.LIST_BYTES - 1))
    assert e.value.status == 413
    bad = {"a": torch.tensor([[1.0, float("inf")]])}
    with pytest.raises(ServeError) as e:
        interp.payload(listed, bad, 1, 1)
    assert e.value.status == 400 and e.value.param == "interp.capture.encoding" and "base64" in e.value.message
    assert interp.payload(spec, bad, 1, 1)[0]["captures"]["a"]["shape"] == [1, 2]  # base64 carries inf exactly


def test_stream_rows_wait_for_every_address():
    full = {"a": torch.arange(10.0)[:, None], "b": -torch.arange(10.0)[:, None]}
    spec = CaptureSpec(points=["z.0"], positions=[2, None])
    rows = interp.StreamRows(spec, ["a", "b"], prompt_len=4, budget=interp.Budget())
    assert rows.add({"a": (0, full["a"][:5])}) == (None, 0)  # b has nothing yet
    part, _ = rows.add({"b": (0, full["b"][:3])})
    assert part["positions"] == [2]
    part2, _ = rows.add({"a": (5, full["a"][5:7]), "b": (3, full["b"][3:7])})
    assert part2["positions"] == [3, 4, 5, 6]
    last, _ = rows.final(full, 10)
    assert last["positions"] == [7, 8, 9]
    for k in full:
        got = torch.cat([encoding.decode(p["captures"][k]) for p in (part, part2, last)])
        assert torch.equal(got, full[k][2:])


def test_admission_is_bounded():
    adm = Admission(3)
    a = adm.enter(2)
    with pytest.raises(ServeError) as e:
        adm.enter(2)
    assert e.value.status == 429 and "2 of 3 sequences pending" in e.value.message and adm.rejected == 1
    with pytest.raises(ServeError) as e:
        adm.enter(4)
    assert e.value.status == 400 and e.value.param == "prompt"
    a.release()
    a.release()  # idempotent
    assert adm.depth == 0 and adm.enter(3).n == 3


def test_guard_auth_and_body_limit():
    async def app(scope, receive, send):
        body = await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    async def run():
        from engine.serve.guard import BodyTooLarge
        guard = Guard(app, "k", 100)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(guard), base_url="http://t") as c:
            assert (await c.post("/v1/x", content=b"a")).status_code == 401
            r = await c.post("/v1/x", content=b"a", headers={"Authorization": "Bearer bad"})
            assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
            ok = {"Authorization": "Bearer k"}
            assert (await c.post("/v1/x", content=b"a" * 100, headers=ok)).text == "100"
            r = await c.post("/v1/x", content=b"a" * 101, headers=ok)
            assert r.status_code == 413 and "101 bytes, over this server's limit of 100" in r.json()["error"]["message"]
            assert (await c.post("/health", content=b"a")).status_code == 200  # open

            async def chunks():  # no Content-Length: counted as it streams in
                for _ in range(5):
                    yield b"a" * 30
            with pytest.raises(BodyTooLarge):
                await c.post("/v1/x", content=chunks(), headers=ok)
    asyncio.run(run())


def test_text_never_ends_in_half_a_character():
    """A generation cut inside a multi-byte character decodes to U+FFFD at its end: dropped, as vLLM's
    server does (old code returned the replacement character)."""
    res = SimpleNamespace(text="caf\ufffd", new_tokens=torch.tensor([5, 6]))
    assert text.finish(res, 2, 3, 256, None, None, 2) == ("caf", "length", None)
    d = text.Detok(SimpleNamespace(decode=lambda ids, skip_special_tokens: "caf"), None)
    assert d.push(5) == "caf" and d.final("caf\ufffd") == ""


def test_health_probe_sees_an_engine_that_computes_non_finite_logits():
    """/health on vLLM probes the engine with one greedy token: unhealthy while its logits are not
    finite, healthy again once they are (old code stayed 503 for good after one bad probe, also after
    the outputs recovered), and each probe's prompt is new, so the prefix cache never answers it from
    blocks computed before (old code sent the same prompt every time)."""
    from engine.serve.runner import VLLMRunner
    logits = [torch.zeros(1, 8)]
    calls = []

    async def generate_batch(reqs, return_logits):
        calls.append(reqs[0].prompt)
        return [SimpleNamespace(logits=logits[0])]

    async def check_health():
        return None
    r = object.__new__(VLLMRunner)
    r.model = SimpleNamespace(aio=SimpleNamespace(_closed=False, generate_batch=generate_batch,
                                                  engine=SimpleNamespace(check_health=check_health)))
    r.limits = SimpleNamespace(vocab_size=100)
    r._probed, r._probe_lock, r._probes = (float("-inf"), None), None, 0
    r.PROBE_EVERY_S = 0.0
    assert asyncio.run(r.problem()) is None
    logits[0] = torch.tensor([[0.0, float("nan")]])
    assert "inf or NaN logits" in asyncio.run(r.problem())
    logits[0] = torch.zeros(1, 8)
    assert asyncio.run(r.problem()) is None
    assert len(calls) == 3 and all(0 < t < 100 for c in calls for t in c)
    assert len({tuple(c) for c in calls}) == 3
    r.PROBE_EVERY_S = 3600.0  # within the interval the latest verdict stands, without a request
    assert asyncio.run(r.problem()) is None and len(calls) == 3


def test_serve_settings_are_checked_once_and_name_the_flag(tmp_path):
    from engine.serve.settings import MIB, ServeSettings, size_for_machine
    s = ServeSettings(served=["a", "b"], max_pending=3)
    assert s.served == ("a", "b") and s.names("m") == ["a", "b"] and ServeSettings().names("m") == ["m"]
    with pytest.raises(Exception):  # frozen: checked once, then trusted
        s.max_pending = 0  # type: ignore[misc]
    for kw, fragment in [({"max_pending": 0}, "max_pending (--max-pending) must be a whole number of at least 1"),
                         ({"cpu_workers": True}, "cpu_workers (--cpu-workers)"),
                         ({"max_response_bytes": -5}, "--max-response-bytes"),
                         ({"max_tokens_limit": 1.5}, "--max-tokens-limit"),
                         ({"served": ("",)}, "--served-model-name"),
                         ({"api_key": " "}, "--api-key"),
                         ({"sae_dir": str(tmp_path / "nope")}, "--sae-dir")]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            ServeSettings(**kw)
    assert ServeSettings(sae_dir=str(tmp_path), max_tokens_limit=None).sae_dir == str(tmp_path)
    # the limits follow the machine: 1/64 of its memory, within [16 MiB, 256 MiB]
    assert size_for_machine(1 << 30) == 16 * MIB and size_for_machine(8 << 30) == 128 * MIB
    assert size_for_machine(64 << 30) == 256 * MIB and size_for_machine(100 << 20) == 16 * MIB


def test_a_bad_flag_fails_before_the_model_loads(capsys, monkeypatch):
    import engine.loading
    from engine.serve import __main__ as cli
    monkeypatch.setattr(engine.loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):
        cli.main(["some/model", "--max-pending", "0", "--port", "0"])
    assert "max_pending (--max-pending) must be a whole number of at least 1" in capsys.readouterr().err


def test_a_stop_on_a_reduced_readout_names_the_per_position_kinds():
    """The kinds the message offers are KINDS' per-position ones, read from the table (a new kind is
    offered without an edit here), in KINDS' order."""
    from engine.core.readouts import KINDS
    from engine.serve.schemas import Interp
    with pytest.raises(ValidationError) as info:
        Interp.model_validate({"capture": {"readouts": [{"address": "resid_post.1", "kind": "Mean", "name": "m"}]},
                               "stop": {"readout": "m", "above": 1}})
    offered = re.search(r"a stop reads a per-position readout \(([^)]*)\)", str(info.value)).group(1).split(", ")
    assert offered == ["Norm", "Project", "LensTopK", "SAEFeatures"]
    assert offered == [n for n, k in KINDS.items() if k.per_position]
