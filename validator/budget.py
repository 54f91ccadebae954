"""How much memory each cell of the matrix needs, and on how many GPUs it fits: the plan's first half.

Counted from the checkpoint's config, never by loading it: the model is built on the meta device
(accelerate's `init_empty_weights`), so its parameter count and per-module sizes are the real ones
for any architecture. A cell holds `copies(engine)` copies of the weights at its peak (what the
runner and the columns keep loaded at once: COPIES), plus the activations of the validator's own
prompts (validator/prompts.py: a batch of two with the long prompt past the sliding window, the
hidden states of every layer, fp32 logits, one layer's eager attention pattern, the decode steps'
KV cache). A vLLM column also needs its own engine: vLLM claims `gpu_memory_utilization` of each GPU
it runs on, so its GPUs are its own, split by tensor parallelism (a divisor of the head count) and
then pipeline parallelism.

GPUs: every copy is placed layer by layer across the devices by accelerate's `infer_auto_device_map`
(what `device_map="auto"` does at load), each copy on what the previous ones left, and the plan asks
for the fewest devices of the stated size on which all of them fit with HEADROOM kept free. The
numbers are estimates from the config: tests/test_validator_budget.py holds the parameter count
against the published one and against a count by hand, and the copies against a run that counts them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

GiB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 0.10  # of each GPU kept free: the CUDA context, the allocator's fragmentation, kernels' workspace
MAX_GPUS = 256  # the plan stops counting here (a cell past it is "needs more than 256 GPUs")
GPUS_PER_NODE = 8  # vLLM's tensor parallelism stays within one node; past it, pipeline stages
VLLM_SHARE = 0.92  # of each of its GPUs vLLM claims (its default gpu_memory_utilization, engine/backends/vllm/sizing.py)

# What stays loaded while one column runs (validator/runner.py, validator/columns.py, the adapters): the base copies
# every column shares, the eager-attention engine when a column compares with it, and the column's own copy.
BASE_COPIES = (("engine", "the engine under test as load_model gives it (runner.run_model)"),
               ("reference", "the pristine HF reference the adapters copy (ModelContext.hf); the hf adapter reads it "
                             "itself (validator/engines/hf_ref.py)"))
EAGER_COPY = "the engine loaded again with attention='eager' (columns.tested_sides), while hf or transformer_lens runs"
OWN_COPY = {"hf": "HF's eager-attention adapter for the pattern rows (columns.eager_pairs)",
            "transformer_lens": "the bridge's copy (ctx.fresh_hf)", "nnsight": "nnsight's copy (ctx.fresh_hf)",
            "nnterp": "the copy nnterp's child process loads", "interp-engine": "interp-engine's copy (ctx.fresh_hf)"}
VLLM_COPY = "a vLLM column's engine, on GPUs of its own (vllm_gpus)"
EAGER_USERS = ("hf", "transformer_lens")


def copies(engine: str, engines: tuple[str, ...]) -> int:
    """Copies of the weights in the validator's process at the peak of `engine`'s column, when the run
    selects `engines` (a vLLM column's own engine is counted apart: vllm_gpus)."""
    eager = any(e in EAGER_USERS for e in engines)
    own = 0 if engine.startswith("vllm") else 1
    return len(BASE_COPIES) + int(eager) + own


@dataclass(frozen=True)
class Shape:
    """What the plan reads of one checkpoint: its parameters (meta device) and the config's sizes."""
    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    window: int
    max_positions: int
    config_from: str  # where the config came from (the checkpoint's config.json, the real-size table, the zoo)

    def weight_bytes(self, dtype: str) -> int:
        return self.params * DTYPE_BYTES[dtype]


def _quiet_accelerate() -> None:
    # planning for GPUs this machine does not have: accelerate warns once per device ("Device 0 is not available")
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)


def config_of(name: str, real: bool) -> tuple[Any, str]:
    """(config, where it came from) of a zoo name: with `real`, the checkpoint's own config.json when it is in
    the local HF cache, else the real-size table (engine/zoo/real.py); otherwise the twin's (this process's size)."""
    from engine.zoo import build, real_checkpoint_available, sizes
    from engine.zoo.names import canonical_name
    name = canonical_name(name)
    if real:
        if real_checkpoint_available(name):
            from transformers import AutoConfig
            return AutoConfig.from_pretrained(name, local_files_only=True), "the checkpoint's config.json"
        return sizes.real_config(name), "the real-size table (engine/zoo/real.py)"
    if sizes.current_size() == "real":
        return sizes.real_config(name), "the real-size twin's config"
    return build.build_config(build.get_entry(name)), "the tiny twin's config"


def meta_model(cfg):
    """The model of `cfg` on the meta device (no memory, no weights), its weights tied as a load ties them."""
    import warnings

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings(), init_empty_weights(include_buffers=False):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg)
    model.tie_weights()
    return model


def _int(cfg, *keys, default: int = 0) -> int:
    for k in keys:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def shape_of(name: str, cfg, model, config_from: str) -> Shape:
    """The plan's view of one checkpoint: the meta model's parameter count and the text config's sizes."""
    from validator.prompts import sliding_window
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = _int(text, "hidden_size", "n_embd", "d_model")
    heads = _int(text, "num_attention_heads", "n_head", "num_heads", "n_heads", default=1)
    params = sum(p.numel() for p in model.parameters())
    return Shape(name, params, _int(text, "num_hidden_layers", "n_layer", "num_layers", "n_layers", default=1), hidden,
                 heads, _int(text, "num_key_value_heads", "num_kv_heads", default=heads),
                 _int(text, "head_dim", default=max(hidden // heads, 1)), _int(text, "vocab_size"),
                 _int(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden), sliding_window(text),
                 _int(text, "max_position_embeddings", "n_positions", "max_seq_len", default=4096), config_from)


def prompt_tokens(shape: Shape) -> int:
    """Tokens of the validator's longest prompt on this model (validator/prompts.py: past the sliding window)."""
    from validator.prompts import DECODE_TOKENS, MIN_LONG
    return min(max(MIN_LONG, shape.window + 16), max(shape.max_positions - DECODE_TOKENS - 1, 1))


def activation_bytes(shape: Shape, dtype: str) -> int:
    """The transient memory of one forward of the padded case (a batch of two at the longest prompt) on the
    main device: every layer's hidden state (output_hidden_states), fp32 logits, one layer's eager attention
    scores and probabilities (fp32), one layer's MLP intermediates, and the decode KV cache."""
    from validator.prompts import DECODE_TOKENS
    b, t, e = 2, prompt_tokens(shape), DTYPE_BYTES[dtype]
    hidden = (shape.layers + 1) * b * t * shape.hidden * e
    logits = b * t * shape.vocab * 4
    pattern = 2 * b * shape.heads * t * t * 4
    mlp = 3 * b * t * shape.intermediate * e
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * b * (t + DECODE_TOKENS) * e
    return hidden + logits + pattern + mlp + kv


@dataclass(frozen=True)
class Devices:
    """The GPUs a cell may use on one node: how many and the memory of each."""
    count: int
    bytes_each: int
    source: str  # how they were found ("visible: ...", "stated: ...")

    @property
    def usable(self) -> int:
        return int(self.bytes_each * (1 - HEADROOM))

    def describe(self) -> str:
        return f"{self.count} x {self.bytes_each / GiB:.0f} GiB ({self.source})"


def devices_at_hand(gpus: int | None = None, gib: float | None = None) -> Devices:
    """The visible CUDA devices (the smallest one's memory), overridden by what is stated: `gpus` per node and
    `gib` each. With no GPU visible and none stated: one 80 GiB GPU, the nightly runner's."""
    import torch
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen:
        mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(seen))
        name = torch.cuda.get_device_name(0)
        found = f"visible: {seen} x {name}"
    else:
        mem, found = 80 * GiB, "no GPU visible here; planned for the nightly runner's 80 GiB GPU"
    stated = [s for s, v in (("--gpus", gpus), ("--gpu-memory", gib)) if v is not None]
    if gpus is not None and gpus < 0:
        raise ValueError(f"--gpus must be 0 or more, got {gpus}.")
    if gib is not None and not gib > 0:
        raise ValueError(f"--gpu-memory must be a positive number of GiB, got {gib}.")
    count = gpus if gpus is not None else max(seen, 1)
    return Devices(count, int(gib * GiB) if gib is not None else mem,
                   f"stated ({', '.join(stated)}); {found}" if stated else found)


def _module_bytes(model, dtype: str) -> dict[str, int]:
    import torch
    from accelerate.utils import compute_module_sizes
    return dict(compute_module_sizes(model, dtype=getattr(torch, dtype)))


def place(model, n_copies: int, reserve: int, dtype: str, per_device: list[int]) -> list[dict[str, Any]] | None:
    """Device maps of `n_copies` copies of `model` placed one after another by accelerate's
    infer_auto_device_map on devices 0..len(per_device)-1 (bytes free on each; `reserve` kept free on device 0
    for the activations), or None when they do not all fit."""
    import torch
    from accelerate import infer_auto_device_map
    _quiet_accelerate()
    free = {i: b for i, b in enumerate(per_device)}
    free[0] -= reserve
    if free[0] < 0:
        return None
    sizes = _module_bytes(model, dtype)
    maps = []
    for _ in range(n_copies):
        dm = infer_auto_device_map(model, max_memory={**free, "cpu": 0}, dtype=getattr(torch, dtype),
                                   no_split_module_classes=list(getattr(model, "_no_split_modules", None) or []))
        if any(not isinstance(d, int) for d in dm.values()):
            return None
        for mod, d in dm.items():
            free[d] -= sizes.get(mod, 0)  # a tied head shares its embedding's storage
        maps.append(dm)
    return maps


def gpus_for(model, shape: Shape, n_copies: int, dtype: str, devices: Devices) -> int:
    """The fewest GPUs of `devices`' size that hold `n_copies` copies and the activations (MAX_GPUS + 1 when
    even MAX_GPUS do not)."""
    total = n_copies * shape.weight_bytes(dtype) + activation_bytes(shape, dtype)
    first = max(1, math.ceil(total / devices.usable))
    for n in range(first, MAX_GPUS + 1):
        if place(model, n_copies, activation_bytes(shape, dtype), dtype, [devices.usable] * n) is not None:
            return n
    return MAX_GPUS + 1


def vllm_gpus(shape: Shape, dtype: str, devices: Devices) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes of a vLLM column's own engine: the weights and a KV cache for the
    validator's prompts within VLLM_SHARE of each GPU; tensor parallel a divisor of the head counts, up to a
    node's GPUS_PER_NODE, then pipeline stages."""
    from validator.prompts import DECODE_TOKENS
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * (prompt_tokens(shape) + DECODE_TOKENS) \
        * DTYPE_BYTES[dtype]
    need = max(1, math.ceil((shape.weight_bytes(dtype) + kv) / (devices.bytes_each * VLLM_SHARE)))
    fits = [t for t in range(1, GPUS_PER_NODE + 1)
            if shape.heads % t == 0 and (shape.kv_heads % t == 0 or t % shape.kv_heads == 0)]
    tp = next((t for t in fits if t >= need), fits[-1])
    return tp, math.ceil(need / tp)


@dataclass(frozen=True)
class Need:
    """One cell's memory and GPUs (on devices of the stated size; placed by accelerate)."""
    copies: int
    weight_bytes: int  # one copy
    activation_bytes: int
    gpus: int  # the validator process's GPUs (0 on a CPU run)
    vllm: bool = False  # a vLLM column: its own engine on GPUs of its own
    tp: int = 1  # that engine's tensor parallel size
    pp: int = 1  # and pipeline stages (its GPUs: tp x pp, besides `gpus`)

    @property
    def total_bytes(self) -> int:
        return self.copies * self.weight_bytes + self.activation_bytes

    @property
    def all_gpus(self) -> int:
        """Every GPU the cell holds: the validator process's and a vLLM column's own engine's."""
        return self.gpus + (self.tp * self.pp if self.vllm and self.gpus else 0)

    def what(self) -> str:
        own = f" + vLLM on {self.tp * self.pp} GPU(s) of its own (tp {self.tp}, pp {self.pp})" if self.vllm else ""
        return (f"{self.copies} x {self.weight_bytes / GiB:.1f} GiB + {self.activation_bytes / GiB:.1f} GiB "
                f"activations{own}")


@lru_cache(maxsize=8)
def _cached_model(name: str, real: bool, size: str):
    cfg, source = config_of(name, real)
    return cfg, meta_model(cfg), source


def needs(name: str, engines: tuple[str, ...], dtype: str, devices: Devices, real: bool,
          on_gpu: bool = True) -> tuple[Shape, dict[str, Need]]:
    """(the model's shape, {engine: its cell's need}) for one model; `on_gpu` False (a CPU run): GPUs 0."""
    from engine.zoo.sizes import current_size
    cfg, model, source = _cached_model(name, real, current_size())
    shape = shape_of(name, cfg, model, source)
    act = activation_bytes(shape, dtype)
    by_copies: dict[int, int] = {}
    out = {}
    for e in engines:
        n = copies(e, engines)
        if on_gpu and n not in by_copies:
            by_copies[n] = gpus_for(model, shape, n, dtype, devices)
        tp, pp = vllm_gpus(shape, dtype, devices) if e.startswith("vllm") and on_gpu else (1, 1)
        out[e] = Need(n, shape.weight_bytes(dtype), act, by_copies.get(n, 0), e.startswith("vllm"), tp, pp)
    return shape, out
