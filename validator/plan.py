"""What the validator checks on one model, decided once before anything is compared.

A `Plan` holds the prompt cases and the compared addresses (validator/matrix.py), and everything
beyond plain capture that users do: other address forms (negative layers, head coordinates, aliases),
steering cases (every op of the op table, several position specs, the residual stream and an
attention-internal point), the logit lens, the readouts, and greedy generation (every step, on the
reference's own tokens; steered at each position spec).

Nothing here depends on what the engine computes, only on what it serves: steering values are drawn
from the HF reference's own activations (so their scale is realistic), the reference tokens come from
the HF reference's own `generate`. The mutation self-test (validator/selftest.py) builds a plan once
and reuses it under every seeded bug.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.points import ALIASES, get_point
from validator import matrix
from validator.engines.base import Case, Missing, split_address
from validator.maths import SAEWeights
from validator.prompts import DECODE_TOKENS

GEN_POSITIONS = ("all", "last", "generated", -3)  # steered generation: each spec once
SEED = 1234


@dataclass(frozen=True)
class Form:
    """Another way to write a compared address: `text` (what a user asks for) names `address` (absolute),
    restricted to `index` on the coordinate axis (axis 2) when it has a coordinate; the result is read
    from the cache under `read` (the text itself, except for a bare point name, which fills every layer)."""
    text: str
    address: str
    kind: str  # "negative layer" | "head" | "stream" | "alias" | "bare name"
    index: int | None = None
    read: str = ""

    @property
    def key(self) -> str:
        return self.read or self.text


@dataclass(eq=False)
class SteerCase:
    """One steering case: an op at an address (with a head coordinate or not), at a position spec,
    with its value and parameters. `name` keys its row."""
    name: str
    op: str
    point: str
    layer: int
    positions: object = "all"
    value: torch.Tensor | None = None
    coeff: float | None = None
    bounds: tuple | None = None
    feature: int | None = None
    head: int | None = None
    sae: SAEWeights | None = None
    sae_dir: str | None = None

    @property
    def address(self) -> str:
        return f"{self.point}.{self.layer}" + (f".head-{self.head}" if self.head is not None else "")

    def params(self) -> dict:
        """Keyword arguments of validator.maths.apply_op."""
        return dict(value=self.value, coeff=self.coeff, bounds=self.bounds, sae=self.sae, feature=self.feature)

    def engine_steer(self):
        """The engine's Steer for this case (public API only)."""
        from engine import Steer
        kw: dict = {}
        if self.coeff is not None:
            kw["coeff"] = self.coeff
        if self.bounds is not None:
            kw["bounds"] = self.bounds
        if self.sae_dir is not None:
            kw.update(sae=self.sae_dir, feature=self.feature)
        return Steer(self.address, self.op, self.value, positions=self.positions, **kw)

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("coeff", self.coeff), ("bounds", self.bounds),
                                                   ("feature", self.feature)) if v is not None)
        return f"{self.op} at {self.address}, positions={self.positions!r}{extra}"


@dataclass(frozen=True)
class ReadoutCase:
    """One readout: `kind` (mean, max, last, norm, project, lens_topk, sae) at `address`."""
    name: str
    kind: str
    address: str
    k: int = 0
    W: torch.Tensor | None = None
    b: torch.Tensor | None = None
    act: str | None = None

    def engine_readout(self, sae_dir: str | None):
        from engine import Last, LensTopK, Max, Mean, Norm, Project, Readout, SAEFeatures
        kind = {"mean": Mean, "max": Max, "last": Last, "norm": Norm}.get(self.kind)
        if kind is not None:
            k = kind()
        elif self.kind == "project":
            k = Project(self.W, self.b, act=self.act)
        elif self.kind == "lens_topk":
            k = LensTopK(self.k)
        else:
            k = SAEFeatures(sae_dir, k=self.k)
        return Readout(self.address, k, name=self.name)


@dataclass
class Plan:
    cases: list[Case]
    addresses: list[str]
    n_layers: int
    forms: list[Form] = field(default_factory=list)
    steers: list[SteerCase] = field(default_factory=list)
    gen_steers: list[SteerCase] = field(default_factory=list)
    lens_layers: list[int] = field(default_factory=list)
    readouts: list[ReadoutCase] = field(default_factory=list)
    sae_dir: str | None = None
    decode_tokens: int = DECODE_TOKENS
    reference: "object | None" = None  # validator.kinds.generation.Generation of the HF reference (or Missing)
    notes: list[str] = field(default_factory=list)

    @property
    def short(self) -> Case:
        return self.cases[0]


# -- building one ----------------------------------------------------------------------------------
def address_forms(addresses: list[str], n_layers: int, coords: dict[str, tuple[str, int]]) -> list[Form]:
    """Every other way users write a compared address: its negative layer; one coordinate (the last head or
    stream, written from the front and from the back) of every point that takes one; every alias of a
    compared point; and a bare layer point name, which means every layer (read at the compared ones)."""
    out: list[Form] = []
    deepest: dict[str, str] = {}  # a bare name's capture is read at the last compared layer of its point
    for a in addresses:
        point, layer = split_address(a)
        if layer is not None:
            out.append(Form(f"{point}.{layer - n_layers}", a, "negative layer"))
            deepest[point] = a
        name, n = coords.get(point, ("", 0))
        if n and layer is not None:
            out.append(Form(f"{a}.{name}-{n - 1}", a, name, n - 1))
            if n > 1:
                out.append(Form(f"{point}.{layer - n_layers}.{name}--{n}", a, name, 0))
        out += [Form(alias, a, "alias") for alias, canon in ALIASES.items() if canon == point]
    return out + [Form(point, a, "bare name", read=a) for point, a in deepest.items()]


def _coords(model) -> dict[str, tuple[str, int]]:
    """{point: (coordinate name, count)} of the points that take a coordinate: heads (query or key/value
    heads) and hyper-connection streams."""
    cfg = model.config
    h = getattr(cfg, "num_attention_heads", 0) or 0
    kv = 1 if getattr(cfg, "multi_query", False) else (getattr(cfg, "num_key_value_heads", None) or h)
    out = {}
    for p in model.points():
        spec = get_point(p)
        if "head" in spec.coords:
            out[p] = ("head", kv if spec.shape.split(",")[2].strip() == "kvh" else h)
        elif "stream" in spec.coords:
            out[p] = ("stream", int(getattr(cfg, "hc_mult", 0) or 0))
    return out


def _direction(g: torch.Generator, shape: tuple, norm: float) -> torch.Tensor:
    v = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (v / v.norm() * norm).float()


def steer_cases(model, ref_acts: dict, sae: SAEWeights | None, sae_dir: str | None, prompt_len: int) -> tuple:
    """(forward cases, generation cases, notes). `ref_acts`: the HF reference's short-prompt activations
    {address: [1, P, *shape] | Missing} at the steered addresses; values are scaled to them."""
    g = torch.Generator().manual_seed(SEED)
    notes = []
    cases: list[SteerCase] = []
    points = model.points()
    if "resid_post" not in points:
        return [], [], [f"no steering parity: the {model.family.name} family has no resid_post"]
    layer = matrix.mid_layer(model)
    a = f"resid_post.{layer}"
    x = ref_acts.get(a)
    if isinstance(x, Missing) or x is None:
        return [], [], [f"no steering parity: the HF reference has no {a} ({getattr(x, 'reason', 'not captured')})"]
    x = x[0].double()  # [P, d]
    d = x.shape[-1]
    rms = float(x.pow(2).mean(-1).sqrt().mean())
    big = rms * math.sqrt(d) * 2.0  # twice a token's norm: moves the logits, stays finite
    v = _direction(g, (d,), big)
    u = (x.mean(0) / x.mean(0).norm()).float()  # the activation's mean direction: removing it changes a lot
    along = x @ u.double()
    P = prompt_len

    def case(name, op, pos="all", **kw) -> SteerCase:
        return SteerCase(name, op, "resid_post", layer, pos, **kw)

    cases += [case(f"add@{p!r}", "add", p, value=v) for p in ("all", "last", 3, -2, [1, P - 4], (2, 5))]
    cases += [
        case("set", "set", "last", value=v),
        case("scale", "scale", "all", value=torch.tensor(0.5)),
        case("scale-elementwise", "scale", (1, 4), value=(torch.rand(d, generator=g) * 2).float()),
        case("ablate", "ablate", -1),
        case("mean_ablate", "mean_ablate", [0, 2], value=x.mean(0).float()),
        case("project_out", "project_out", "all", value=u * 3.0),
        case("rescale", "rescale", "all", value=u, coeff=3.0),
        case("projection_cap", "projection_cap", "all", value=u, bounds=(None, float(along.median()))),
        case("norm_scaled_add", "norm_scaled_add", "all", value=u, coeff=0.75),
        case("swap", "swap", (1, None), value=_direction(g, (P, d), big * math.sqrt(P))),
    ]
    if sae is not None:
        feat = int(sae.encode(x).sum(0).argmax())  # an active feature, so clamp and scale change something
        for op, coeff in (("feature_clamp", 5.0), ("feature_scale", 3.0), ("feature_add", 2.0)):
            cases.append(case(op, op, "all", coeff=coeff, feature=feat, sae=sae, sae_dir=sae_dir))
    # an attention-internal point: z (per head) where it is the output projection's input, else attn_out
    inner = _inner_point(model, ref_acts)
    if isinstance(inner, str):
        notes.append(inner)
    else:
        point, ilayer, t = inner
        t = t[0].double()  # [P, *shape]
        shape = tuple(t.shape[1:])
        tn = float(t.reshape(P, -1).norm(dim=1).mean()) * 2.0
        vi = _direction(g, shape, tn)
        ui = (t.mean(0) / t.mean(0).norm()).float()
        cases += [SteerCase(f"{point}:add", "add", point, ilayer, "last", value=vi),
                  SteerCase(f"{point}:project_out", "project_out", point, ilayer, "all", value=ui),
                  SteerCase(f"{point}:scale", "scale", point, ilayer, (2, 6), value=torch.tensor(-1.0)),
                  SteerCase(f"{point}:ablate", "ablate", point, ilayer, "all")]
        if point == "z":
            h = shape[0] - 1
            cases += [SteerCase("z-head:add", "add", "z", ilayer, "all", value=vi[h] * 2.0, head=h),
                      SteerCase("z-head:scale", "scale", "z", ilayer, [-1, -3], value=torch.tensor(0.0), head=h)]
    gen = [SteerCase(f"gen:add@{p!r}", "add", "resid_post", layer, p, value=v) for p in GEN_POSITIONS]
    gen.append(SteerCase("gen:project_out@'generated'", "project_out", "resid_post", layer, "generated", value=u))
    return cases, gen, notes


def inner_address(model) -> str | None:
    """The attention-internal address the steering cases use: z at its middle layer when the model has z
    and no attention gate (so z is the output projection's input), else attn_out at its middle layer."""
    points = model.points()
    for p in ("z", "attn_out"):
        if p == "z" and ("z" not in points or "attn_gate" in points):
            continue
        if p in points:
            layers = model.point_layers(p)
            if layers:
                mid = min(layers, key=lambda x: (abs(x - (model.n_layers - 1) / 2), x))
                return f"{p}.{mid}"
    return None


def _inner_point(model, ref_acts: dict):
    a = inner_address(model)
    if a is None:
        return "no attention-internal steering case: the model has neither z nor attn_out"
    t = ref_acts.get(a)
    if isinstance(t, Missing) or t is None:
        return f"no attention-internal steering case: the HF reference has no {a} ({getattr(t, 'reason', '')})"
    point, layer = split_address(a)
    return point, layer, t


def readout_cases(model, sae: SAEWeights | None, d_model: int) -> list[ReadoutCase]:
    """Every readout kind at resid_post's middle layer (Project with a seeded probe)."""
    if "resid_post" not in model.points():
        return []
    a = f"resid_post.{matrix.mid_layer(model)}"
    g = torch.Generator().manual_seed(SEED + 1)
    W = torch.randn(3, d_model, generator=g) / math.sqrt(d_model)
    out = [ReadoutCase(f"{a}:{k}", k, a) for k in ("mean", "max", "last", "norm")]
    out += [ReadoutCase(f"{a}:project", "project", a, W=W, b=torch.tensor([0.1, -0.2, 0.3]), act="sigmoid"),
            ReadoutCase(f"{a}:lens_topk", "lens_topk", a, k=5)]
    if sae is not None:
        out.append(ReadoutCase(f"{a}:sae", "sae", a, k=6))
    return out


def build(model, cases: list[Case], addresses: list[str], ref_acts: dict, workdir: Path, steer: bool = True,
          decode: bool = True) -> Plan:
    """The plan of one model: `model` is the engine under test (its catalogue only), `ref_acts` the HF
    reference's short-prompt activations at the steered addresses (validator.plan.steer_addresses)."""
    plan = Plan(cases, addresses, model.n_layers, forms=address_forms(addresses, model.n_layers, _coords(model)),
                decode_tokens=DECODE_TOKENS if decode else 0)
    plan.lens_layers = [split_address(a)[1] for a in addresses if split_address(a)[0] == "resid_post"]
    sae = None
    if "resid_post" in model.points():
        layer = matrix.mid_layer(model)
        x = ref_acts.get(f"resid_post.{layer}")
        # decoder rows about as long as a token's residual, so feature edits are felt
        norm = float(x[0].double().norm(dim=-1).mean()) if isinstance(x, torch.Tensor) else 1.0
        sae = SAEWeights.random(model.d_model, 2 * model.d_model, SEED + 2, scale=norm)
        plan.sae_dir = str(sae.write(workdir / "sae", f"blocks.{layer}.hook_resid_post"))
    plan.readouts = readout_cases(model, sae, model.d_model)
    if steer:
        plan.steers, plan.gen_steers, notes = steer_cases(model, ref_acts, sae, plan.sae_dir,
                                                          int(cases[0].input_ids.shape[1]))
        plan.notes += notes
        if not decode:
            plan.gen_steers = []
    return plan


def steer_addresses(model) -> list[str]:
    """What the HF reference captures before the plan is built (the steered addresses)."""
    out = []
    if "resid_post" in model.points():
        out.append(f"resid_post.{matrix.mid_layer(model)}")
    inner = inner_address(model)
    if inner:
        out.append(inner)
    return out
