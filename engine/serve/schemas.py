"""Request bodies, checked before anything runs, with messages that name the field.

Only structure and the model-independent rules live here. What a point address, a steering op or a
position spec means is checked by the engine itself (engine.core.address.parse, engine.core.steering.Steer,
engine.core.positions.normalize), so names, ops and refusals have one source; what depends on the loaded
model (a point it lacks, a steering value of the wrong width) is checked by engine/serve/interp.py
against the model. Unknown fields are refused rather than ignored: a misspelt `interp` key must not
silently return nothing.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from engine.core import positions as engine_positions
from engine.core.address import parse
from engine.core.errors import SAEError
from engine.core.points import ALIASES, BY_NAME
from engine.core.readouts import KINDS, Readout
from engine.core.steering import Steer
from engine.serve import encoding
from engine.serve.errors import ServeError, from_validation

if TYPE_CHECKING:
    import torch

INT32 = (1 << 31) - 1  # counts vLLM keeps in int32 (a bigger one would fail inside the engine, not here)
# entries one request may name: checked before any is built (10,000 identity steers took 4.7 s to check)
MAX_STEERS, MAX_READOUTS, MAX_POINTS = 256, 256, 1024


class Body(BaseModel):
    # allow_inf_nan: JSON's Infinity / NaN (which Python's parser accepts) is never a valid number here;
    # strict: a number is a JSON number and a flag a JSON boolean, as the OpenAI API specifies ("5",
    # true for 1 and "yes" for true are refused by name, not coerced)
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False, strict=True)


def positions_in(p: Any) -> "str | int | slice | list[int] | torch.Tensor":
    """A position spec from JSON: "all" | "last" | "generated" | int | [start, stop] (null = open) |
    {"at": [int, ...]} (explicit positions) | {"mask": [bool, ...]} (a mask over positions; [[...]]:
    one row per sequence)."""
    if isinstance(p, dict):
        return _positions_object(p)
    if isinstance(p, list):
        if len(p) != 2:
            raise ValueError(f'positions as a list is a range [start, stop] (null = open), got {len(p)} items; '
                             f'explicit positions are {{"at": [int, ...]}}')
        p = tuple(p)
    return engine_positions.normalize(p)


def _positions_object(p: dict) -> "list[int] | torch.Tensor":
    if set(p) == {"at"} and isinstance(p["at"], list):
        return engine_positions.normalize(p["at"])
    if set(p) == {"mask"} and isinstance(p["mask"], list):
        m = p["mask"]
        rows = m if m and isinstance(m[0], list) else [m]
        if not all(isinstance(r, list) and all(isinstance(x, bool) for x in r) for r in rows) \
                or len({len(r) for r in rows}) > 1 or sum(map(len, rows)) > encoding.MAX_ELEMENTS:
            raise ValueError("a positions mask is a list of booleans, or a list of equal-length lists of booleans "
                             "(one per sequence)")
        import torch
        return engine_positions.normalize(torch.tensor(m, dtype=torch.bool))
    raise ValueError('positions as an object is {"at": [int, ...]} or {"mask": [bool, ...]}')


def _address(p: str) -> str:
    if "." not in p and (p in BY_NAME or p in ALIASES):
        return p  # a bare name: every layer that has the point (PointCatalogue.expand)
    parse(p)  # AddressError names the point and the fix
    return p


PointName = Annotated[str, AfterValidator(_address)]


def sae_in(v: Any, info: ValidationInfo) -> str | None:
    """An SAE named by a request: a folder inside the server's --sae-dir (never a path outside it)."""
    if v is None:
        return None
    root = (info.context or {}).get("sae_dir")
    # SAEError: the library's class for an SAE it cannot find, which the remote client raises again
    if root is None:
        raise SAEError("this server serves no SAEs; start it with --sae-dir DIR and name an SAE folder inside it")
    if not isinstance(v, str) or not v:
        raise SAEError("an SAE is named by its folder inside the server's --sae-dir (a string)")
    base = Path(root).resolve()
    path = (base / v).resolve()
    if base not in path.parents or not path.is_dir():
        raise SAEError(f"no SAE folder {v!r} inside this server's --sae-dir")
    return str(path)


def _sae_field(cls, v, info: ValidationInfo):
    return sae_in(v, info)


def _json_in(conv):
    return classmethod(lambda cls, v: v if v is None else conv(v))


def _spec(name: str, base: type[BaseModel], doc: str, json_fields: dict[str, Any], fields: dict[str, Any]) -> Any:
    """The HTTP model of one engine type: `fields` (generated from the type's own fields), each of
    `json_fields` decoded from JSON by its converter, `sae` checked against the server's --sae-dir;
    `base` builds the engine object once the fields are valid (one validation, the type's own)."""
    validators = {f"_in_{k}": field_validator(k)(_json_in(conv)) for k, conv in json_fields.items()}
    validators["_in_sae"] = field_validator("sae")(classmethod(_sae_field))
    return create_model(name, __base__=base, __doc__=doc, __validators__=validators, **fields)  # type: ignore[call-overload]


# engine.core.readouts' kinds, each by its class name with its own fields (generated from
# dataclasses.fields of every kind: a field added to a kind is served here; the kind checks values).
_KIND_FIELDS = {name: [f.name for f in dataclasses.fields(k)] for name, k in KINDS.items()}
_KIND_JSON = {"W": encoding.value_in, "b": encoding.value_in}


class _ReadoutBody(Body):
    _readout: Readout | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _build(self):
        kind = self.kind
        given = {f for f in self.model_fields_set if f not in ("address", "kind", "name")}
        wrong = sorted(given - set(_KIND_FIELDS[kind]))
        if wrong:
            raise ValueError(f"readout kind {kind!r} takes no {', '.join(wrong)} (it takes: "
                             f"{', '.join(_KIND_FIELDS[kind]) or 'nothing'})")
        self._readout = Readout(self.address, KINDS[kind](**{f: getattr(self, f) for f in given}), self.name)
        return self

    @property
    def readout(self) -> Readout:
        return self._readout


ReadoutSpec: Any = _spec(
    "ReadoutSpec", _ReadoutBody, "One engine.core.readouts.Readout in JSON: address, kind (a class name of "
    "engine.core.readouts.KINDS), the kind's own fields (W / b as tensors or nested lists; sae: a folder inside the "
    "server's --sae-dir) and an optional name.", _KIND_JSON,
    {"address": (str, ...), "kind": (Literal[tuple(KINDS)], ...), "name": (str | None, None),  # type: ignore[valid-type]
     **{f: (Any, None) for f in dict.fromkeys(f for fs in _KIND_FIELDS.values() for f in fs)}})


class StopSpec(Body):
    """Stop a generation at the first token whose readout score crosses a threshold. readout: the name
    of a per-position readout of interp.capture.readouts; the score of generated token i is that
    readout at the position it was predicted from (the last row of the forward that produced it);
    index: which output of a multi-output readout (a probe row, or a feature / token id of a sparse
    one, scored by its value when among the top k, else -inf)."""
    readout: str
    above: float | None = None
    below: float | None = None
    index: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one(self):
        if (self.above is None) == (self.below is None):
            raise ValueError("give exactly one of above / below")
        return self


class CaptureSpec(Body):
    """What to capture and how to return it. points: addresses (a bare layer point = every layer);
    positions: which token positions to return (the steering vocabulary); reduction over them;
    readouts: reductions computed where the activation is (returned whole, per position or reduced)."""
    points: list[PointName] = Field(default_factory=list, max_length=MAX_POINTS)
    positions: Any = "all"
    reduction: Literal["none", "last", "mean"] = "none"
    encoding: Literal["base64", "list"] = "base64"
    readouts: list[ReadoutSpec] = Field(default_factory=list, max_length=MAX_READOUTS)

    @field_validator("positions")
    @classmethod
    def _positions(cls, v):
        return positions_in(v)

    @model_validator(mode="after")
    def _something(self):
        if not self.points and not self.readouts:
            raise ValueError("give points or readouts to capture")
        names = [r.readout.name for r in self.readouts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"two readouts are named {dup[0]!r}; give one of them a name")
        return self


# engine.core.steering.Steer's own fields (those a request sets), each a JSON field of a steer; the ones JSON
# cannot carry directly are converted here. Generated from dataclasses.fields(Steer): a field added there
# is served here, and Steer itself checks every value (one validation).
_STEER_FIELDS = [f for f in dataclasses.fields(Steer) if not f.metadata.get("engine")]
_STEER_JSON = {"value": encoding.value_in, "positions": positions_in}
_STEER_TYPES = {"address": str, "op": str}


class _SteerBody(Body):
    _steer: Steer | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _build(self):
        self._steer = Steer(**{f.name: getattr(self, f.name) for f in _STEER_FIELDS})
        return self

    @property
    def steer(self) -> Steer:
        return self._steer


SteerSpec: Any = _spec(
    "SteerSpec", _SteerBody, "One engine.core.steering.Steer in JSON (its fields, by name). value: a number (scale), "
    "nested lists, or a tensor object (engine/serve/encoding.py); bounds: [min, max].", _STEER_JSON,
    {f.name: (_STEER_TYPES.get(f.name, Any), ... if f.default is dataclasses.MISSING else f.default)
     for f in _STEER_FIELDS})


class Interp(Body):
    """The per-request interpretability field: captures to return and steers to apply. strict (on
    by default): a steer that touched no row fails the request (a 400 naming it) instead of coming
    back with a receipt of 0 rows."""
    capture: CaptureSpec | None = None
    steer: list[SteerSpec] = Field(default_factory=list, max_length=MAX_STEERS)
    strict: bool = True
    stop: StopSpec | None = None
    logits: bool = False  # generation: each new token's logits [new, vocab] (the library's return_logits=True)

    @model_validator(mode="after")
    def _stop_reads_a_readout(self):
        if self.stop is not None:
            found = [r.readout for r in (self.capture.readouts if self.capture else [])
                     if r.readout.name == self.stop.readout]
            if not found:
                raise ValueError(f"interp.stop.readout {self.stop.readout!r} names no readout of interp.capture.readouts")
            if not found[0].kind.per_position:
                kinds = ", ".join(n for n, k in KINDS.items() if k.per_position)
                raise ValueError(f"interp.stop.readout {self.stop.readout!r} is reduced over positions; a stop reads a "
                                 f"per-position readout ({kinds})")
        return self

    @field_validator("capture", mode="before")
    @classmethod
    def _short(cls, v):
        if isinstance(v, str):
            return {"points": [v]}
        if isinstance(v, list):  # shorthand: a list of points
            return {"points": v}
        return v


def prompts_in(p: Any) -> list:
    """The prompts of an OpenAI `prompt`: a string, a list of strings, a list of token ids or a list
    of token-id lists."""
    def ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if ids(p):
            return [p]
        if all(isinstance(x, str) for x in p) or all(ids(x) for x in p):
            return list(p)
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Sampling(Body):
    """The OpenAI sampling fields this server honours, plus vLLM's common extensions (top_k, min_p,
    min_tokens, ignore_eos, repetition_penalty, stop_token_ids). temperature defaults to 1.0 as in
    OpenAI's API; pass 0 for greedy."""
    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float | None = Field(None, ge=0, le=100)  # above ~100 sampling is uniform; 1e308 overflows
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)  # what vLLM's int64 seed takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict | None = None
    interp: Interp | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is served (got {v}); send one request per sample (vary seed)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server; steer the model instead (interp.steer)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        v = [v] if isinstance(v, str) else v
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v or None


def _refuse(name: str, why: str, allowed=(None, False)):
    def check(cls, v):
        if not any(v is a or (type(v) is type(a) and v == a) for a in allowed):
            raise ValueError(f"{name} is not supported by this server: {why}")
        return v
    return field_validator(name)(classmethod(check))


class CompletionRequest(Sampling):
    prompt: Any
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    _prompt = field_validator("prompt")(classmethod(lambda cls, v: prompts_in(v)))
    _echo = _refuse("echo", "the prompt's tokens are in interp.prompt_token_ids when interp is set")
    _best_of = _refuse("best_of", "send several requests", (None, 1))
    _suffix = _refuse("suffix", "no insertion mode")
    _logprobs = _refuse("logprobs", "capture 'final_norm' and apply the unembedding, or use the library's "
                                    "generate(return_logits=True)")


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    _logprobs = _refuse("logprobs", "capture 'final_norm' and apply the unembedding, or use the library's "
                                    "generate(return_logits=True)")
    _top = _refuse("top_logprobs", "logprobs are not served", (None, 0))

    @model_validator(mode="after")
    def _budget(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; send one")
            self.max_tokens = self.max_completion_tokens
        return self


class CaptureRequest(Body):
    """/v1/capture: one forward over each prompt (no generation), with interp.capture and
    interp.steer; return_logits adds the logits at the selected positions."""
    model: str | None = None
    prompt: Any
    interp: Interp
    return_logits: bool = False

    _prompt = field_validator("prompt")(classmethod(lambda cls, v: prompts_in(v)))


# -- a request body, parsed and checked once ----------------------------------------------------------
_B = TypeVar("_B", bound=BaseModel)


class LongNumber:
    """An integer in a request too long for Python to read (over sys.get_int_max_str_digits() digits):
    kept as this marker, so the field holding it is refused by name like any other wrong type."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a number of {self.digits} digits>"


def _long_int(text: str) -> int | LongNumber:
    digits = len(text.lstrip("-"))
    return LongNumber(digits) if digits > sys.get_int_max_str_digits() else int(text)


def parse_body(raw: bytes, cls: type[_B], sae_dir: str | None = None) -> _B:
    """A request body as `cls`, or a 400 naming what is wrong (sae_dir: the server's --sae-dir, the only
    place a request may name an SAE)."""
    if not raw.strip():
        raise ServeError(400, "request body is empty; send a JSON object")
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ServeError(400, f"request body is not valid JSON ({getattr(e, 'msg', e)}{where})") from None
    except RecursionError:
        raise ServeError(400, "request body nests JSON arrays or objects too deep to parse; a request needs "
                              "only a few levels") from None
    except ValueError:  # an integer past Python's digit limit (4300): read again, to name its field
        obj = json.loads(raw, parse_int=_long_int)
    if not isinstance(obj, dict):
        raise ServeError(400, f"request body must be a JSON object, got a JSON {type(obj).__name__}")
    try:
        return cls.model_validate(obj, context={"sae_dir": sae_dir})
    except ValidationError as e:
        raise from_validation(e) from None
    except RecursionError:
        raise ServeError(400, "request body nests JSON arrays or objects too deep to check") from None
