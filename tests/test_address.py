"""Address grammar and the point catalogue: strict parsing, clear errors."""
import re

import numpy as np
import pytest
import torch

from engine.core.address import Address, parse
from engine.core.errors import AddressError
from engine.core.points import BY_NAME, POINTS, backend_status, get_point


def test_catalogue_has_the_anchor_points_plus_q_and_k():
    # the anchor's 34, post-RoPE q and k, lm_head_raw, and the two stream-collapse weight points
    assert len(POINTS) == 39
    assert len(BY_NAME) == 39, "point names must be unique"
    for name in ("embeddings", "resid_pre", "q", "k", "attn_scores", "z", "mlp_act", "router_logits",
                 "resid_post", "final_norm", "lm_head", "resid_streams", "mlp_stream_mix"):
        assert name in BY_NAME
    for p in POINTS:
        assert p.definition and p.shape.startswith("[b, pos"), p.name
        assert p.scope in ("layer", "trunk")


@pytest.mark.parametrize("text,point,layer,coords", [
    ("resid_post.10", "resid_post", 10, ()),
    ("resid_post.-1", "resid_post", -1, ()),
    ("z.4.head-3", "z", 4, (("head", 3),)),
    ("final_norm", "final_norm", None, ()),
    ("logits", "lm_head", None, ()),
    ("resid_streams.2.stream-1", "resid_streams", 2, (("stream", 1),)),
])
def test_parse_round_trip(text, point, layer, coords):
    a = parse(text)
    assert (a.point, a.layer, a.coords) == (point, layer, coords)
    assert parse(str(a)) == a


def test_constructor_equals_parsed():
    assert Address("resid_post", 10) == parse("resid_post.10")
    assert Address("z", 4, head=3) == parse("z.4.head-3")
    assert hash(Address("q", 1)) == hash(parse("q.1"))


def test_negative_layers_resolve_from_the_end():
    assert parse("resid_post.-1").resolved(12).layer == 11
    assert parse("resid_post.-12").resolved(12).layer == 0
    assert parse("final_norm").resolved(12).layer is None


@pytest.mark.parametrize("text,fragment", [
    ("resid_pots.3", "Did you mean 'resid_post'"),
    ("resid_post", "needs a layer"),
    ("final_norm.3", "trunk point and takes no layer"),
    ("z.1.heads-2", "takes no coordinate 'heads'"),
    ("resid_post.1.head-2", "takes no coordinate 'head'"),
    ("resid_post.x", "cannot parse 'x'"),
    ("", "an address is a string"),
    # one spelling per address, in ASCII digits: '-0' was layer 0 (not the last), '\u0661' (Arabic-Indic
    # one) was layer 1, through str.isdigit / the regex's Unicode \d
    ("resid_post.-0", "layer '-0' in address 'resid_post.-0' is not written plainly: write 0 (the first) or -1"),
    ("resid_post.\u0661", "has a digit outside ASCII 0-9; write layers and coordinates with ASCII digits"),
    ("resid_post.\uff11", "has a digit outside ASCII 0-9"),  # a fullwidth one
    ("resid_post.01", "layer '01' in address 'resid_post.01' is not written plainly: write 1"),
    ("z.1.head--0", "coordinate head '-0' in address 'z.1.head--0' is not written plainly"),
    ("z.1.head-\u0663", "has a digit outside ASCII 0-9"),
    # one coordinate once: the last of two used to win silently
    ("z.0.head-1.head-2", "address 'z.0.head-1.head-2' gives coordinate 'head' twice; give it once, e.g. 'z.0.head-1'"),
    ("z.0.head-1.head-1", "gives coordinate 'head' twice"),
])
def test_parse_errors_name_the_problem(text, fragment):
    with pytest.raises(AddressError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse(text)


@pytest.mark.parametrize("layer", [12, -13, 100])
def test_layer_out_of_range(layer):
    with pytest.raises(AddressError, match=r"out of range .* 12 layers \(valid: 0\.\.11"):
        parse(f"resid_post.{layer}").resolved(12)


def test_backend_status_table():
    assert backend_status("resid_post", "eager") == ("hook", "")
    status, reason = backend_status("q_norm_in", "vllm")
    assert status == "refused" and "vLLM" in reason and "backend='eager'" in reason
    assert backend_status("attn_scores", "eager")[0] == "recompute"
    assert backend_status("resid_post", "vllm-generate")[0] == "refused"
    assert get_point("logits").name == "lm_head"


def test_key_axis_is_a_point_trait_read_by_every_module_that_pads_or_recomputes_patterns():
    """Point traits live on Point: the attention-pattern points are the ones whose capture shape has a
    key-position axis, and the modules that treat them specially read that trait instead of a literal list."""
    from engine.backends.vllm.worker import attn
    from engine.core import plan, results
    from engine.core.points import KEY_AXIS_POINTS
    with_kpos = [p.name for p in POINTS if "kpos" in p.shape.strip("[]").replace(" ", "").split(",")]
    assert list(KEY_AXIS_POINTS) == with_kpos and with_kpos  # non-empty, and exactly the kpos shapes
    assert get_point("attn_probs").key_axis and not get_point("z").key_axis
    assert results.PATTERNS is KEY_AXIS_POINTS and attn.ATTN_POINTS is KEY_AXIS_POINTS
    assert plan.KEY_AXIS_POINTS is KEY_AXIS_POINTS


@pytest.mark.parametrize("layer,head", [(np.int64(3), np.int32(1)), (torch.tensor(3), torch.tensor(1)),
                                        (np.array(3), np.uint8(1))])
def test_integer_scalars_are_layers_and_coordinates(layer, head):
    """Any integer scalar (numpy's, a 0-d integer tensor) is the int it holds, stored as a Python int."""
    a = Address("z", layer, head=head)
    assert a == Address("z", 3, head=1) and type(a.layer) is int and type(a.coords[0][1]) is int
    assert str(a) == "z.3.head-1"


@pytest.mark.parametrize("bad,shown", [(3.0, "float 3.0"), (True, "bool True"), (torch.tensor([3]), "Tensor tensor([3])"),
                                       (torch.tensor(3.0), "Tensor tensor(3.)"), ("3", "str '3'")])
def test_non_integers_are_refused_as_layers_naming_what_was_given(bad, shown):
    with pytest.raises(AddressError, match=re.escape(f"layer must be an int (numpy and 0-d tensor integers too), "
                                                     f"got {shown}.")):
        Address("resid_post", bad)
    with pytest.raises(AddressError, match=re.escape(f"coordinate head must be an int (numpy and 0-d tensor "
                                                     f"integers too), got {shown}.")):
        Address("z", 0, head=bad)
