"""The eager backend: an HF model with hooks. Serves every point the family has, capture and
steering, prefill and generation, with gradients."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from engine import attention, lens, sites
from engine.catalogue import PointCatalogue
from engine.address import Address, closest, parse
from engine.errors import AddressError, SteeringError, UnsupportedPointError
from engine.families.base import Family
from engine.hooks import HookSet
from engine.points import INTEGER_POINTS, backend_status, get_point
from engine.steering import Steer, apply_steer, position_mask


class ActivationCache(dict):
    """Captured tensors keyed by address string; also indexable by Address or 'point.-1'."""

    def __init__(self, n_layers: int):
        super().__init__()
        self.n_layers = n_layers

    def _key(self, key):
        return str(parse(key).resolved(self.n_layers))

    def __getitem__(self, key):
        k = self._key(key)
        if not dict.__contains__(self, k):
            raise KeyError(f"{k!r} was not captured; captured: {', '.join(self) or 'nothing'}.")
        return dict.__getitem__(self, k)

    def __contains__(self, key):
        try:
            return dict.__contains__(self, self._key(key))
        except AddressError:
            return False


@dataclass
class _Step:
    """Where the current forward chunk sits: absolute offset, decode or prefill, per-row last index."""
    offset: int = 0
    decoding: bool = False
    last_index: torch.Tensor | None = None
    shape: tuple = (0, 0)


def _split_kv(t, positions: int, compress_rate: int):
    """(window part, compressor entries) of a pattern's key axis. Compressed-KV layers (DeepSeek-V4
    CSA/HCA) append one compressor entry per `compress_rate` positions seen so far after the window."""
    extra = positions // compress_rate if compress_rate else 0
    cut = t.shape[-1] - extra
    return t[..., :cut], t[..., cut:]


def _pad_key_axis(key: str, chunks: list, compress_rate: int = 0) -> list:
    """Attention patterns grow a key axis at every decode step ([b, 1, h, kpos] with kpos = prompt + step);
    right-pad the earlier chunks (probability 0, or a masked score) so the steps concatenate by position.
    On compressed-KV layers the padding goes between the positions and the compressor entries, so
    every step keeps the layout [positions..., compressor entries...]."""
    n = max(c.shape[-1] for c in chunks)
    if key.split(".")[0] not in ("attn_scores", "attn_probs") or all(c.shape[-1] == n for c in chunks):
        return chunks
    fill = torch.finfo(chunks[0].dtype).min if key.startswith("attn_scores") else 0.0
    if not compress_rate:
        return [torch.nn.functional.pad(c, (0, n - c.shape[-1]), value=fill) for c in chunks]
    seen, parts = 0, []
    for c in chunks:  # chunk i covers positions up to the running total of query lengths
        seen += c.shape[1]
        parts.append(_split_kv(c, seen, compress_rate))
    width = max(w.shape[-1] for w, _ in parts)
    extra = max(e.shape[-1] for _, e in parts)
    pad = torch.nn.functional.pad
    return [torch.cat([pad(w, (0, width - w.shape[-1]), value=fill), pad(e, (0, extra - e.shape[-1]), value=fill)],
                      dim=-1) for w, e in parts]


def _absolute_keys(key: str, t, step, compress_rate: int = 0) -> "torch.Tensor":
    """At a decode step a sliding-window cache holds only the last keys, so a pattern's key axis is
    shorter than the absolute positions it covers; left-pad it (probability 0, or a masked score) so
    that key index k is position k, as in prefill. Compressor entries after the window (DeepSeek-V4's
    compressed layers) are not positions: only the window part is padded, so the decode-time layout
    is the prefill one, [positions..., compressor entries...]."""
    if not step.decoding or key.split(".")[0] not in ("attn_scores", "attn_probs"):
        return t
    total = step.offset + t.shape[1]
    window, entries = _split_kv(t, total, compress_rate)
    missing = total - window.shape[-1]
    if missing <= 0:
        return t
    fill = torch.finfo(t.dtype).min if key.startswith("attn_scores") else 0.0
    return torch.cat([torch.nn.functional.pad(window, (missing, 0), value=fill), entries], dim=-1)


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [b, prompt + new]
    new_tokens: torch.Tensor  # [b, new]
    text: list[str]
    cache: ActivationCache  # [b, positions processed, ...]: prompt then each fed-back token
    logits: torch.Tensor | None = None  # [b, new, vocab], the scores each new token was chosen from
    extra: dict = field(default_factory=dict)


class EagerModel(PointCatalogue):
    backend = "eager"

    def __init__(self, name: str, hf, tokenizer, family: Family, source: str):
        self.name, self.hf, self.tokenizer, self.family, self.source = name, hf, tokenizer, family, source
        self.config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        self.n_layers = len(sites.get_path(hf, family.layers))
        self.d_model = self.config.hidden_size
        self.device = next(hf.parameters()).device
        self.dtype = next(hf.parameters()).dtype
        if family.attn_interface:
            attention.use_on(hf)
        self._step = _Step()
        self._point_layers: dict[str, list[int]] = {}

    def __repr__(self):
        return (f"<{type(self).__name__} {self.name} ({self.source}, family={self.family.name}, "
                f"layers={self.n_layers}, d_model={self.d_model}, backend={self.backend})>")

    # -- the point catalogue for this model -----------------------------------------------------
    def _probe(self, point, layer):
        sites.resolve(self.hf, self.family, point, layer, self._shape)

    def address(self, a) -> Address:
        """Parse and check an address against this model and backend; absolute layer."""
        addr = parse(a).resolved(self.n_layers)
        status, reason = backend_status(addr.point, self.backend)
        if status == "refused":
            raise UnsupportedPointError(f"{addr} cannot be served by backend {self.backend!r}: {reason}.")
        layers = self.point_layers(addr.point)
        if not layers:
            have = self.points()
            try:  # the family's own reason (a refusal, a missing module), from the first layer
                sites.resolve(self.hf, self.family, addr.point, 0 if addr.layer is None else addr.layer, self._shape)
                why = ""
            except UnsupportedPointError as e:
                why = f": {str(e).split(': ', 1)[-1].rstrip('.')}"
            raise UnsupportedPointError(
                f"{addr.point!r} does not exist in the {self.family.name} family "
                f"({self.config.model_type}){why}.{closest(addr.point, have)} This model has: {', '.join(have)}.")
        if addr.layer is not None and addr.layer not in layers:
            try:
                sites.resolve(self.hf, self.family, addr.point, addr.layer, self._shape)
            except UnsupportedPointError as e:
                raise UnsupportedPointError(f"{str(e).rstrip('.')}. It exists at layers {layers}.") from None
        for name, value in addr.coords:
            n = self._coord_size(addr.point, name)
            if not -n <= value < n:
                raise AddressError(f"{name} {value} is out of range for {addr.point!r} ({n} {name}s).")
        return addr

    def _coord_size(self, point, name):
        cfg = self.config
        if name == "head":
            if point not in ("k", "value", "k_norm_in", "k_norm_out"):
                return cfg.num_attention_heads
            if getattr(cfg, "multi_query", False):  # gpt_bigcode / falcon MQA: one shared key/value head
                return 1
            return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return getattr(cfg, "hc_mult", 1)

    def _shape(self):
        return self._step.shape

    def _compress_rate(self, addr: Address) -> int:
        """Positions per compressor entry on this layer's attention key axis (DeepSeek-V4 CSA/HCA
        layers); 0 where the key axis holds positions only."""
        if addr.point not in ("attn_scores", "attn_probs") or addr.layer is None or not self.family.attn:
            return 0
        attn = sites.get_path(self.hf, f"{self.family.layers}.{addr.layer}.{self.family.attn}")
        return int(getattr(getattr(attn, "compressor", None), "compress_rate", 0) or 0)

    # -- tokens ---------------------------------------------------------------------------------
    def to_tokens(self, text, padding_side: str = "left") -> dict:
        """Tokenize a string or a list of strings into input_ids / attention_mask (padded batch)."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
        texts = [text] if isinstance(text, str) else list(text)
        tok = self.tokenizer
        tok.padding_side = padding_side
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok(texts, return_tensors="pt", padding=True)
        return {"input_ids": enc["input_ids"].to(self.device), "attention_mask": enc["attention_mask"].to(self.device)}

    def _inputs(self, inputs) -> dict:
        if isinstance(inputs, (str, list)) and (isinstance(inputs, str) or isinstance(inputs[0], str)):
            return self.to_tokens(inputs)
        if isinstance(inputs, torch.Tensor):
            ids = inputs if inputs.dim() == 2 else inputs[None]
            return {"input_ids": ids.to(self.device), "attention_mask": torch.ones_like(ids).to(self.device)}
        if isinstance(inputs, dict) and "input_ids" in inputs:
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            return {"input_ids": ids, "attention_mask": mask if mask is not None else torch.ones_like(ids)}
        raise TypeError(f"inputs must be text, a list of texts, a token tensor or a dict with input_ids; "
                        f"got {type(inputs).__name__}.")

    # -- hooks ------------------------------------------------------------------------------------
    def _site(self, addr: Address):
        return sites.resolve(self.hf, self.family, addr.point, addr.layer, self._shape)

    def _hookset(self, capture: list[Address], steers: list[Steer], store: dict, detach: bool) -> HookSet:
        hs = HookSet()
        for st in steers:
            addr = self.address(st.address)
            st = Steer(addr, st.op, st.value, st.positions)
            if addr.point in INTEGER_POINTS:
                raise UnsupportedPointError(f"{addr} is capture-only.")
            why = self.family.capture_only.get(addr.point) or (self._site(addr.base).extra or {}).get("capture_only")
            if why:
                raise SteeringError(f"{addr} can be captured but not steered on this model: {why}.")

            def write(t, st=st):
                s = self._step
                mask = position_mask(st.positions, t.shape[1], s.offset, s.decoding,
                                     None if s.decoding else s.last_index, t.device)
                return apply_steer(st, t, mask)

            hs.add(self._site(addr.base), addr.point, write, "write")
        for addr in capture:
            key = str(addr)
            coords = dict(addr.coords)
            rate = self._compress_rate(addr)

            def read(t, key=key, coords=coords, rate=rate):
                full = t
                if coords:
                    (_, idx), = coords.items()
                    t = t[:, :, idx]
                t = _absolute_keys(key, t, self._step, rate)
                if detach:
                    store.setdefault(key, []).append(t.detach().clone())
                    return None
                # with gradients the capture must stay in the graph, so the model carries on with a
                # copy instead: HF edits some outputs in place after the hook (Falcon's parallel
                # block adds the attention output into mlp_out), which must not reach the capture
                store.setdefault(key, []).append(t)
                return full.clone()

            hs.add(self._site(addr.base), addr.point, read, "read")
        if any(self._site(a).get is not None and get_point(a.point).group == "moe" for a in capture + [
                self.address(s.address) for s in steers]):
            blk0 = sites.get_path(self.hf, f"{self.family.layers}.0")

            def shape_hook(module, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                self._step.shape = tuple(h.shape[:2])
            hs._handles.append(blk0.register_forward_pre_hook(shape_hook, with_kwargs=True))
        return hs

    @staticmethod
    def _position_ids(mask: torch.Tensor) -> torch.Tensor:
        return (mask.long().cumsum(-1) - 1).clamp_min(0)

    def _last_index(self, mask):
        left_padded = bool((mask[:, -1] == 1).all())
        return None if left_padded else mask.long().sum(-1) - 1

    # -- public API -------------------------------------------------------------------------------
    def run_with_cache(self, inputs, points=(), steer=(), grad: bool = False):
        """One forward. Returns (logits [b, pos, vocab], ActivationCache of [b, pos, ...] tensors)."""
        enc = self._inputs(inputs)
        capture = self.expand(points) if points else []
        steers = [steer] if isinstance(steer, Steer) else list(steer)
        store: dict = {}
        self._step = _Step(0, False, self._last_index(enc["attention_mask"]), tuple(enc["input_ids"].shape))
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx, self._hookset(capture, steers, store, detach=not grad):
            out = self.hf(**enc, position_ids=self._position_ids(enc["attention_mask"]), use_cache=False)
        cache = ActivationCache(self.n_layers)
        for k, v in store.items():
            cache[k] = v[0] if len(v) == 1 else torch.cat(v, dim=1)
        return out.logits, cache

    def forward(self, inputs, steer=()):
        return self.run_with_cache(inputs, (), steer)[0]

    @contextlib.contextmanager
    def steering(self, *steers: Steer):
        """Apply steers to every forward inside the block (composable; removed on exit)."""
        hs = self._hookset([], list(steers), {}, True)
        with hs:
            yield self

    def generate(self, inputs, max_new_tokens: int = 8, points=(), steer=(), do_sample=False, **kw):
        """Greedy (by default) generation with capture and steering in prefill and every step."""
        enc = self._inputs(inputs)
        capture = self.expand(points) if points else []
        steers = [steer] if isinstance(steer, Steer) else list(steer)
        store: dict = {}
        mask = enc["attention_mask"]
        if not bool((mask[:, -1] == 1).all()):
            raise ValueError("generate needs left padding (pad on the left so every row ends in a real "
                             "token); use model.to_tokens(texts, padding_side='left').")
        self._step = _Step(0, False, None, tuple(enc["input_ids"].shape))

        def step_hook(module, args, kwargs):
            ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
            prev = self._step
            if started:
                self._step = _Step(prev.offset + prev.shape[1], True, None, tuple(ids.shape))
            else:
                started.append(True)
                self._step = _Step(0, False, None, tuple(ids.shape))

        started: list = []
        handle = self.hf.register_forward_pre_hook(step_hook, with_kwargs=True)
        try:
            with torch.no_grad(), self._hookset(capture, steers, store, detach=True):
                out = self.hf.generate(**enc, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                       min_new_tokens=max_new_tokens, output_logits=True,
                                       return_dict_in_generate=True,
                                       pad_token_id=self.tokenizer.pad_token_id, **kw)
        finally:
            handle.remove()
        cache = ActivationCache(self.n_layers)
        for k, v in store.items():
            cache[k] = torch.cat(_pad_key_axis(k, v, self._compress_rate(self.address(k))), dim=1)
        seq = out.sequences
        new = seq[:, enc["input_ids"].shape[1]:]
        logits = torch.stack(out.logits, dim=1) if out.logits else None
        text = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return GenerationResult(seq, new, text, cache, logits)

    def logit_lens(self, x, point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor (or an address captured in `x` when x is (cache, address))."""
        if isinstance(x, tuple):
            cache, a = x
            addr = parse(a)
            lens.check_lensable(addr.point)
            if addr.coords:
                raise AddressError(f"logit lens of {addr} needs the whole point; drop the coordinate.")
            point, x = addr.point, cache[a]
        else:
            lens.check_lensable(get_point(point).name)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"logit lens needs a [..., {self.d_model}] residual, got shape {tuple(x.shape)}.")
        n_streams = getattr(self.config, "hc_mult", None)
        if point == "resid_streams" and (x.dim() < 3 or x.shape[-2] != n_streams):
            raise ValueError(f"logit lens of resid_streams needs [..., {n_streams}, {self.d_model}] (all streams), "
                             f"got shape {tuple(x.shape)}.")
        with torch.no_grad():
            return lens.unembed(self.hf, self.family, x.to(self.dtype), apply_norm=(point != "final_norm"),
                                streams=(point == "resid_streams"))
