"""What a vLLM request's workers send back, made into results (engine/backends/vllm/replies.py), and a
stream's steps cut from what was read (engine/backends/vllm/streaming.py): on hand-made worker replies
and vLLM outputs, so no vLLM engine runs. The end-to-end paths (a real engine's collect and stream) are
in test_vllm.py and test_vllm_interventions.py."""
from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest
import torch

from engine.backends.vllm import replies, streaming
from engine.backends.vllm.worker import wire
from engine.core.address import Address
from engine.core.errors import EngineError, EngineFailure, SAEError, SteeringError
from engine.core.plan import Plan
from engine.core.readouts import ReadoutError
from engine.core.results import ActivationCache, Receipt, RequestResult, StreamStep
from engine.core.steering import NonFiniteSteer, Steer


class Catalogue:
    """The two facts replies reads from a catalogue: a point's shape and whether it is sharded."""

    def __init__(self, sharded: bool, shape: tuple) -> None:
        self.sharded, self.shape = sharded, shape

    def info(self, addr: Address) -> dict:
        return {"sharded": self.sharded, "shape": self.shape}


def _rank(key: str, rows: torch.Tensor, held: list[int] | None = None, **more) -> wire.CollectReply:
    """A rank's reply as the client reads it: encoded by the worker (out), read back (read)."""
    reply = wire.CollectReply("req", captures={key: [0, wire.tensor_out(rows)]}, held={key: held or []}, **more)
    return wire.CollectReply.read(reply.out())


def _out(tokens: list[int], cached: int = 0):
    """A stand-in for vLLM's final RequestOutput: its one completion's token ids."""
    return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens)], num_cached_tokens=cached)


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def test_gather_puts_each_ranks_heads_of_a_sharded_point_in_place():
    full = torch.arange(5 * 4 * 3, dtype=torch.float32).reshape(5, 4, 3)  # [pos, heads, d_head]
    held = [[0, 2], [1, 3]]  # interleaved, so an order-only concatenation would be wrong
    ranks = [_rank("z.1", full[:, h], h) for h in held]
    got = replies.gather(Catalogue(True, (4, 3)), "z.1", ranks)
    assert torch.equal(got, full)
    # a replicated point (or one head asked for) comes from the first rank that holds it
    assert torch.equal(replies.gather(Catalogue(False, (4, 3)), "z.1", ranks), full[:, [0, 2]])


def test_gather_says_which_capture_is_missing_or_failed():
    with pytest.raises(RuntimeError, match=r"^resid_post\.0 was never computed for this request\.$"):
        replies.gather(Catalogue(False, (8,)), "resid_post.0", [wire.CollectReply("req")])
    failed = wire.CollectReply("req", errors={"resid_post.0": wire.Failure("RuntimeError", "resid_post.0: out of memory")})
    with pytest.raises(EngineFailure, match=r"^RuntimeError: resid_post\.0: out of memory$"):
        replies.gather(Catalogue(False, (8,)), "resid_post.0", [failed])


def _result(ranks, plan=None, prefill=False, want_logits=False, tokens=(7, 8)):
    plan = plan or Plan(3, [Address("resid_post", 0)])
    return replies.request_result(plan, [1, 2, 3], (), _out(list(tokens)), ranks, want_logits, prefill,
                                  catalogue=Catalogue(False, (2,)), n_layers=2, tokenizer=Tok())


def test_a_request_result_holds_its_tokens_captures_text_and_logits_from_the_last_prompt_position():
    rows = torch.randn(4, 2)  # the prompt (3) and the first new token fed back
    logits = torch.randn(5, 11)  # from position 1 (the worker's logits_from) on
    rank = _rank("resid_post.0", rows, logits=wire.tensor_out(logits), logits_from=1, recomputed=2)
    res = _result([rank], want_logits=True)
    assert res.prompt_ids.tolist() == [1, 2, 3] and res.new_tokens.tolist() == [7, 8]
    assert res.text == "<7><8>" and res.recomputed == 2 and res.cached_tokens == 0
    assert torch.equal(res.cache["resid_post.0"], rows)
    # the scores each new token was chosen from: the last prompt position (2) on, one per new token
    assert torch.equal(res.logits, logits[1:3])
    assert torch.equal(_result([rank], want_logits=True, prefill=True).logits, logits)  # a forward: every row
    assert _result([rank]).logits is None


ALONE = r" \(this request alone failed inside the vLLM worker; other requests and the engine are unaffected\)$"


@pytest.mark.parametrize("raised, cls, match", [
    (NonFiniteSteer("add at resid_post.0 made 2 rows non-finite"), NonFiniteSteer,
     r"^add at resid_post\.0 made 2 rows non-finite" + ALONE),
    (SteeringError("no row selected"), SteeringError, r"^no row selected" + ALONE),
    (ReadoutError("LensTopK k=9 exceeds the vocabulary's 8 tokens"), ReadoutError, r"^LensTopK k=9 exceeds the vocabulary.s 8 tokens" + ALONE),
    (SAEError("sae: '/x' is not a directory"), SAEError, r"^sae: '/x' is not a directory" + ALONE),
    (RuntimeError("CUDA error"), EngineFailure, r"^RuntimeError: CUDA error" + ALONE),
])
def test_a_request_failed_in_a_worker_raises_the_class_the_worker_raised(raised, cls, match):
    """The failure crosses as a declared type (wire.Failure: class and message) and is raised again as that
    class; it crossed as a "Class: message" string, and anything but two named classes came back as a bare
    EngineError (an SAE feature out of range: SteeringError on eager, EngineError on vLLM)."""
    reply = wire.CollectReply("req", failed=wire.Failure.of(raised))
    with pytest.raises(cls, match=match) as e:
        _result([wire.CollectReply.read(reply.out())])
    assert type(e.value) is cls


def test_a_collect_reply_crosses_as_plain_data_and_reads_back_whole():
    """What collective_rpc carries (msgpack: dicts, lists, str, int, bytes; nothing else) holds every field."""
    import msgspec
    rows, logits = torch.randn(3, 2), torch.randn(2, 5)
    reply = wire.CollectReply("req", captures={"z.1": [4, wire.tensor_out(rows)]}, held={"z.1": [0, 2]},
                              readouts={"n": wire.encode([rows[:, 0]])},
                              errors={"q.0": wire.Failure.of(ReadoutError("bad"))}, logits=wire.tensor_out(logits),
                              logits_from=2, recomputed=1,
                              receipts=[Receipt(0, "z.1", "add", 3, 1.5)], failed=wire.Failure.of(SteeringError("x")))
    back = wire.CollectReply.read(msgspec.msgpack.decode(msgspec.msgpack.encode(reply.out())))
    assert back.key == "req" and back.held == {"z.1": [0, 2]} and back.logits_from == 2 and back.recomputed == 1
    assert back.captures["z.1"][0] == 4 and torch.equal(wire.tensor_in(back.captures["z.1"][1]), rows)
    assert torch.equal(wire.tensor_in(back.logits), logits) and back.receipts == reply.receipts
    assert back.errors == {"q.0": wire.Failure("ReadoutError", "bad")} and back.failed == wire.Failure("SteeringError", "x")
    assert torch.equal(wire.decode(back.readouts["n"])[0], rows[:, 0])
    assert {f.name for f in dataclasses.fields(wire.CollectReply)} == set(reply.out())  # one field list


def test_a_peek_reply_crosses_as_plain_data_and_reads_back_whole():
    """A running request's rows and per-position readouts (interp_peek) read back under their own fields: a
    field added to PeekReply once shifted the positional read, and a stream's readouts came back None."""
    import msgspec
    rows = torch.randn(3, 4)
    reply = wire.PeekReply("req", captures={"resid_post.1": [2, wire.tensor_out(rows)]}, held={"z.1": [0, 1]},
                           readouts={"p": [2, wire.encode([rows[:, 0]])]})
    back = wire.PeekReply.read(msgspec.msgpack.decode(msgspec.msgpack.encode(reply.out())))
    assert back.key == "req" and back.held == {"z.1": [0, 1]} and back.errors == {}
    assert back.captures["resid_post.1"][0] == 2 and torch.equal(wire.tensor_in(back.captures["resid_post.1"][1]), rows)
    first, parts = back.readouts["p"]
    assert first == 2 and torch.equal(wire.decode(parts)[0], rows[:, 0])
    assert {f.name for f in dataclasses.fields(wire.PeekReply)} - {"errors"} == set(reply.out())  # one field list


def test_captures_sent_in_one_stack_read_back_each_as_its_row():
    """vllm-static sends a request's every layer as one tensor (CollectReply.stacks); each capture refers to
    its row and reads back as that tensor, through msgpack and through a shared-memory file alike."""
    import tempfile

    import msgspec

    from engine.backends.vllm.worker import sink
    stack = torch.randn(3, 5, 4)
    for encode in (wire.tensor_out, lambda t: sink.to_file(t, tempfile.mkdtemp(dir="/dev/shm"))):
        reply = wire.CollectReply("req", stacks=[encode(stack)],
                                  captures={f"resid_post.{j}": [2, {wire.STACK: 0, "index": j}] for j in range(3)})
        back = wire.CollectReply.read(msgspec.msgpack.decode(msgspec.msgpack.encode(reply.out())))
        assert back.stacks == [] and set(back.captures) == {"resid_post.0", "resid_post.1", "resid_post.2"}
        for j in range(3):
            first, rows = back.captures[f"resid_post.{j}"]
            assert first == 2 and torch.equal(wire.tensor_in(rows), stack[j])


def test_a_capture_handed_through_a_file_reads_back_as_often_as_it_is_gathered():
    """A capture the worker wrote to shared memory (worker/sink.py) is mapped once, when its reply is read:
    the file is unlinked as it is mapped, and a request gathers some captures more than once (attention
    patterns are recomputed from q and k, and q is asked too). Mapped at each gather, the second raised
    'unable to open file' (test_vllm.py's prefill comparison on the hooked backend)."""
    import tempfile

    import msgspec

    from engine.backends.vllm.worker import sink
    rows = torch.randn(5, 4)
    for make, read in ((wire.CollectReply, wire.CollectReply.read), (wire.PeekReply, wire.PeekReply.read)):
        reply = make("req", captures={"resid_post.0": [0, sink.to_file(rows, tempfile.mkdtemp(dir="/dev/shm"))]})
        back = read(msgspec.msgpack.decode(msgspec.msgpack.encode(reply.out())))
        for _ in range(2):
            assert torch.equal(replies.gather(Catalogue(False, (4,)), "resid_post.0", [back]), rows)


def test_a_lost_plan_and_a_missing_output_are_the_engines_errors():
    with pytest.raises(EngineError, match=r"^a worker lost this request's plan: unknown key abc$"):
        _result([wire.CollectReply("req", lost="unknown key abc")])
    with pytest.raises(EngineError, match=r"aborted\?"):
        replies.request_result(Plan(3), [1, 2, 3], (), None, None, False, False, catalogue=Catalogue(False, (2,)),
                               n_layers=2, tokenizer=Tok())


def test_receipts_come_back_one_per_steer_with_sharded_changes_added_in_quadrature():
    plan = Plan(3, [], [Steer("z.0", "add", torch.ones(3))])
    ranks = [wire.CollectReply("req", receipts=[Receipt(0, "z.0", "add", 3, 3.0)]),
             wire.CollectReply("req", receipts=[Receipt(0, "z.0", "add", 3, 4.0)])]
    (r,) = _result(ranks, plan).receipts
    assert (r.rows, r.change_norm, r.op) == (3, 5.0, "add")


def _req(prompt: list[int], new: list[int], rows: torch.Tensor, logits: bool = True) -> RequestResult:
    cache = ActivationCache(1)
    cache["resid_post.0"] = rows
    lg = torch.full((len(new), 3), float(len(prompt))) if logits else None
    return RequestResult(torch.tensor(prompt), torch.tensor(new), "", cache, lg)


def test_a_calls_requests_are_padded_like_eagers_prompts_left_new_tokens_right():
    a = _req([1, 2, 3], [4, 5], torch.arange(4.0).reshape(4, 1))  # 3 + 2 - 1 positions fed
    b = _req([6], [7], torch.tensor([[9.0]]))  # stopped after one token
    out = replies.batch_result([a, b], pad=0, n_layers=1)
    assert out.tokens.tolist() == [[1, 2, 3, 4, 5], [0, 0, 0, 6, 7]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert out.new_tokens.tolist() == [[4, 5], [7, 0]]
    assert out.cache["resid_post.0"][:, :, 0].tolist() == [[0, 1, 2, 3], [0, 0, 0, 9]]
    assert out.logits[:, :, 0].tolist() == [[3, 3], [1, 0]]
    assert replies.batch_result([a, _req([6], [7], torch.tensor([[9.0]]), logits=False)], 0, 1).logits is None


def test_a_stream_step_holds_the_rows_of_the_forward_that_made_its_token():
    rows = {"a": torch.arange(6.0), "b": torch.arange(3.0)}  # "b" read only up to position 2
    assert {k: t.tolist() for k, t in streaming.step_rows(rows, 3, 0).items()} == {"a": [0, 1, 2], "b": [0, 1, 2]}
    assert {k: t.tolist() for k, t in streaming.step_rows(rows, 3, 1).items()} == {"a": [3]}
    assert streaming.step_rows(rows, 3, 4) == {}


def test_token_logprobs_keep_the_sampled_token_and_the_n_most_likely():
    lp = lambda v, r: types.SimpleNamespace(logprob=v, rank=r)  # noqa: E731
    entry = {5: lp(-0.1, 1), 9: lp(-2.0, 2), 2: lp(-3.0, 3), 4: lp(-9.0, None)}
    assert streaming.token_logprobs(entry, 4, 2) == (-9.0, {5: -0.1, 9: -2.0})
    assert streaming.token_logprobs(None, 4, 2) == (None, {})


def _run_stream(outputs: list[tuple[list[int], bool]]) -> tuple[list[StreamStep], list[int]]:
    """Stream a request whose vLLM outputs are `outputs` ((new token ids, finished) each), capturing
    resid_post.0 of a 2-token prompt (position p holds p). A peek answers with the rows the workers have
    computed: the prompt and every token seen but the newest. Returns the steps and where each peek began."""
    plan = Plan(2, [Address("resid_post", 0)])
    every = torch.arange(10.0).reshape(10, 1)
    seen, peeks = [0], []

    async def start(on_output, key, hold):
        for ids, finished in outputs:
            seen[0] += len(ids)
            on_output(types.SimpleNamespace(finished=finished,
                                            outputs=[types.SimpleNamespace(token_ids=ids, logprobs=None)]))
            await asyncio.sleep(0)
        await hold.wait()
        cache = ActivationCache(1)
        cache["resid_post.0"] = every[:2 + seen[0] - 1]
        return [RequestResult(torch.tensor([1, 2]), torch.tensor(sum((i for i, _ in outputs), [])), "", cache, None)]

    async def peek(key, since, since_r):
        lo, hi = since["resid_post.0"], 2 + seen[0] - 1
        peeks.append(lo)
        since["resid_post.0"] = hi
        return {"resid_post.0": every[lo:hi]}, {}

    async def collect():
        return [s async for s in streaming.stream_steps(plan, start, peek, lambda t: f"<{t}>", 0, True, False)]
    return asyncio.run(collect()), peeks


def test_a_streams_steps_carry_their_forwards_rows_and_the_last_carries_the_result():
    steps, peeks = _run_stream([([10], False), ([11], False), ([12], True)])
    assert [s.token for s in steps] == [10, 11, 12] and [s.text for s in steps] == ["<10>", "<11>", "<12>"]
    assert [s.rows["resid_post.0"][:, 0].tolist() for s in steps] == [[0, 1], [2], [3]]
    assert [s.result is not None for s in steps] == [False, False, True]
    assert peeks == [0]  # one peek, at the second token, served the first step; the last step reads the result


def test_a_stream_whose_request_fails_raises_its_error_after_the_steps_it_made():
    got: list = []

    async def consume():
        plan = Plan(2)

        async def start(on_output, key, hold):
            on_output(types.SimpleNamespace(finished=False, outputs=[types.SimpleNamespace(token_ids=[10], logprobs=None)]))
            await asyncio.sleep(0)
            raise NonFiniteSteer("add at resid_post.0 made 1 row non-finite")

        async def peek(key, since, since_r):
            return {}, {}
        async for s in streaming.stream_steps(plan, start, peek, str, 0, False, False):
            got.append(s)

    with pytest.raises(NonFiniteSteer, match="made 1 row non-finite"):
        asyncio.run(consume())
    assert got == []  # the one token seen waits for the next, which never came
