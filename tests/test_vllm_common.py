"""Shared helpers of the vLLM backend tests (no tests here): one engine per (model, backend) for
the whole session, eager references on the same zoo weights, comparisons at the validator's
tolerances (validator/tolerances.py: vllm float32 tier; decode x10)."""
from __future__ import annotations

import gc
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from engine.core.points import get_point
from engine.loading import load_model
from validator.scoring import compare
from validator.tolerances import STEER_MIN_EFFECT, tier_for

PROMPT = "The quick brown fox jumps over the lazy dog"
PROMPTS = [PROMPT, "Hello world, this is a test of the tiny models"]
MAX_LEN = 256
# The session's vllm-static tap set on the tiny Llama (test_api_errors.py, test_feature_steering.py,
# test_harvest_vllm.py, test_readouts.py, test_vllm_interventions.py, test_vllm_ops.py, test_vllm_static.py and
# test_vllm_syncs.py share its engine; the last of them closes it): every tap kind, the residual stream and the embeddings, an
# attention input, per-head z, module outputs, a mid residual, the MLP hidden. Two banks: d_model 256 (all but
# mlp_act) and mlp_act's 512.
STATIC_TAPS = ["resid_post", "embeddings", "attn_in.1", "z.1", "attn_out", "resid_mid.1", "mlp_act.0", "mlp_out.1"]
_ENGINES: dict = {}
_EAGER: dict = {}


def vllm_model(name: str, backend: str = "vllm", **kw):
    """One engine per (name, backend, options) for the session (vLLM startup costs ~10-50 s)."""
    key = (name, backend, tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _ENGINES:
        _ENGINES[key] = load_model(name, backend=backend, source="zoo", max_model_len=MAX_LEN, **kw)
    return _ENGINES[key]


def drop(model) -> None:
    """Free an engine when a test module is done with it."""
    for k, v in list(_ENGINES.items()):
        if v is model:
            del _ENGINES[k]
            v.close()
    gc.collect()


def _status(pid: int) -> dict[str, str] | None:
    """/proc/PID/status as fields (None: the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}


def _dying(fields: dict[str, str] | None) -> bool:
    """Whether a process (its status fields) can no longer run: gone, a zombie, or SIGKILL pending."""
    if fields is None or fields.get("State", "")[:1] in ("Z", "X"):
        return True
    sigkill = 1 << 8  # signal 9 is bit 8 of the pending masks
    return any(int(fields.get(k, "0"), 16) & sigkill for k in ("SigPnd", "ShdPnd"))


def children_left_running(before: set[int], timeout: float = 60.0) -> dict[int, str]:
    """Child processes started since `before` (pids) that can still run after up to `timeout` s, with
    their /proc state. A SIGKILLed engine core on a loaded machine can take a while to be reaped (it
    failed CI once at 20 s), so a process that is gone, a zombie or has SIGKILL pending counts as
    released; one that can still run does not."""
    deadline = time.monotonic() + timeout
    while True:
        new = {p.pid for p in multiprocessing.active_children()} - before
        running = {pid: f for pid in new if pid is not None and not _dying(f := _status(pid))}
        if not running or time.monotonic() > deadline:
            return {pid: f"State:\t{f['State']}" for pid, f in running.items() if f is not None}
        time.sleep(0.2)


def eager_model(name: str):
    if name not in _EAGER:
        _EAGER[name] = load_model(name, backend="eager", source="zoo")
    return _EAGER[name]


def check(ours, ref, point: str, engine: str = "vllm", case: str = "", what: str = ""):
    """Assert ours matches ref at the validator's tolerance; return the score."""
    s = compare(ours, ref, tier_for(engine, "float32", case), point)
    assert s.verdict == "pass", f"{what or point}: {s.verdict} {s.to_dict()}"
    return s


def shared_points(vm, em) -> list[str]:
    """Points the vLLM backend serves on this model that eager also has."""
    have = set(em.points())
    return [p for p in vm.points() if p in have]


def prefill_failures(vm, em, prompt=PROMPT, points=None, engine="vllm") -> dict:
    """{address: problem} for every capture of `points` (default: all shared) in one prefill."""
    points = points or shared_points(vm, em)
    lv, cv = vm.run_with_cache(prompt, points)
    le, ce = em.run_with_cache(prompt, points)
    bad = {}
    for key in list(ce):
        if key not in cv:
            bad[key] = "not captured by vLLM"
            continue
        s = compare(cv[key], ce[key], tier_for(engine, "float32"), get_point(key.split(".")[0]).name)
        if s.verdict != "pass":
            bad[key] = s.to_dict()
    s = compare(lv, le, tier_for(engine, "float32"), "lm_head")
    if s.verdict != "pass":
        bad["logits"] = s.to_dict()
    return bad


def decode_failures(vm, em, points, prompt=PROMPT, n=4, steer=(), engine="vllm") -> dict:
    """Captures during generation (prompt + fed-back tokens), tokens and logits vs eager generate.
    Attention scores/probs are left out: their key axis grows per step, so eager cannot stack them."""
    points = [p for p in points if p.split(".")[0] not in ("attn_scores", "attn_probs")]
    gv = vm.generate(prompt, n, points=points, steer=steer)
    ge = em.generate(prompt, n, points=points, steer=steer)
    bad = {}
    if not torch.equal(gv.new_tokens, ge.new_tokens):
        bad["tokens"] = f"{gv.new_tokens.tolist()} vs eager {ge.new_tokens.tolist()}"
    for key in ge.cache:
        s = compare(gv.cache[key], ge.cache[key], tier_for(engine, "float32", "decode"), key.split(".")[0])
        if s.verdict != "pass":
            bad[key] = s.to_dict()
    s = compare(gv.logits, ge.logits, tier_for(engine, "float32", "decode"), "lm_head")
    if s.verdict != "pass":
        bad["logits"] = s.to_dict()
    return bad


def steer_effect(model, prompt, steer, n=4) -> float:
    """Relative change of the generated logits under `steer` (a steer that changes nothing is a no-op)."""
    base = model.generate(prompt, n).logits
    moved = model.generate(prompt, n, steer=steer).logits
    return float((moved - base).norm() / base.norm())


def assert_steer_acts(model, prompt, steer, n=4):
    eff = steer_effect(model, prompt, steer, n)
    assert eff > STEER_MIN_EFFECT, f"steer {steer} moved the logits by only {eff:.2e}"


def random_vector(shape, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def stream_under_steering(m, tier: str, n: int = 6) -> None:
    """Streams made in a `steering()` block, iterated in it and after it, give what generate gives in
    the block (tokens, logits, captured rows), and the steer acts."""
    from engine.core.steering import Steer
    st = Steer("resid_post.0", "add", random_vector((m.d_model,), 31, 8.0))
    base = m.generate(PROMPT, n)
    with m.steering(st):
        ref = m.generate(PROMPT, n, points=["resid_post.1"])
        inside = list(m.stream(PROMPT, n, points=["resid_post.1"]))
        later = m.stream(PROMPT, n, points=["resid_post.1"])  # made in the block, iterated after it
    after = list(later)
    moved = float((ref.logits - base.logits).norm() / base.logits.norm())
    assert moved > STEER_MIN_EFFECT, f"the steer moved the logits by only {moved:.2e}"
    for steps in (inside, after):
        assert [s.token for s in steps] == ref.new_tokens[0].tolist()
        res = steps[-1].result
        check(res.logits, ref.logits[0], "lm_head", tier, case="decode")
        check(res.cache["resid_post.1"][None], ref.cache["resid_post.1"], "resid_post", tier, case="decode")
    assert torch.equal(m.generate(PROMPT, n).new_tokens, base.new_tokens)  # nothing left behind


needs_vllm = pytest.mark.vllm
