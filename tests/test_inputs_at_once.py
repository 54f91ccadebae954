"""The whole-batch input checks (engine/core/inputs._valid_at_once on host arrays, engine/core/results.one_run_per_row)
agree with the per-row checks they stand in front of, and the eager backend still names what is wrong."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from engine import load_model
from engine.core.errors import InputError
from engine.core.inputs import Limits, _valid_at_once, token_rows
from engine.core.results import one_run_per_row


def _one_run_per_row_reference(mask: torch.Tensor) -> bool:
    for row in mask.tolist():
        cols = [i for i, v in enumerate(row) if v]
        if not cols or cols[-1] - cols[0] + 1 != len(cols):
            return False
    return True


def test_one_run_per_row_matches_the_per_row_definition():
    for width in range(1, 7):
        for bits in itertools.product([0, 1], repeat=width):
            for dtype in (torch.long, torch.bool, torch.float32):
                m = torch.tensor([bits], dtype=dtype)
                assert one_run_per_row(m) == _one_run_per_row_reference(m), (bits, dtype)
    rng = random.Random(0)
    for _ in range(500):  # several rows: one bad row makes the batch bad
        m = torch.tensor([[rng.random() < 0.7 for _ in range(6)] for _ in range(rng.randint(2, 4))])
        assert one_run_per_row(m) == _one_run_per_row_reference(m)


def test_valid_at_once_never_passes_what_the_row_checks_refuse():
    rng, agree, passed = random.Random(1), 0, 0
    torch.manual_seed(1)
    for _ in range(3000):
        b, w = rng.randint(1, 4), rng.randint(1, 9)
        ids = torch.randint(-2, 12, (b, w))
        if rng.random() < 0.7:
            ids = ids.clamp(0, 9)
        dtype = rng.choice([torch.long, torch.int32, torch.uint8, torch.float32, torch.bool])
        ids = ids.bool() if dtype is torch.bool else ids.to(dtype)
        mask = (torch.rand(b, w) < rng.choice([0.3, 0.9, 1.0])).long()
        limits = Limits("m", rng.choice([10, None, 5]), rng.choice([None, 4, 8, 20]), capture_new=rng.choice([0, 1]))
        new = rng.choice([None, 0, 2, 5])
        batch = {"input_ids": ids, "attention_mask": mask}
        fast = _valid_at_once(ids.numpy(), mask.numpy(), limits, new)
        try:
            token_rows(batch, None, limits, new=new)
            slow = True
        except (InputError, TypeError):
            slow = False
        assert slow or not fast, batch
        agree += fast == slow
        passed += fast
    assert passed > 300 and agree == 3000  # it also takes every batch the row checks take


def test_valid_at_once_leaves_other_forms_to_the_row_checks():
    limits = Limits("m", 10, 8)
    assert _valid_at_once(np.array([[1, 2]]), np.array([[1, 1]]), limits, 0)
    assert not _valid_at_once(np.array([1, 2]), np.array([1, 1]), limits, 0)  # 1-D: host_batch adds the batch axis
    assert not _valid_at_once(np.array([[1, 2]]), np.array([[1, 0, 1]]), limits, 0)
    assert not _valid_at_once(np.array([[1.0, 2.0]]), np.array([[1, 1]]), limits, 0)  # float ids: the row checks say why
    assert not _valid_at_once(np.array([[True, False]]), np.array([[1, 1]]), limits, 0)
    assert not _valid_at_once(np.array([[1, 2], [3]], dtype=object), np.array([[1, 1], [1]], dtype=object), limits, 0)


@pytest.fixture(scope="module")
def model():
    return load_model("meta-llama/Llama-3.2-1B")


def test_eager_still_names_a_gap_and_a_bad_id(model):
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    with pytest.raises(ValueError, match=r"attention_mask row 1 has padding between real tokens; pad on one side only"):
        model.run_with_cache({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 1]])}, "resid_post.0")
    vocab = model.hf.get_input_embeddings().num_embeddings
    bad = torch.tensor([[5, 6, 7], [0, 5, vocab]])
    with pytest.raises(InputError, match=rf"token id {vocab} at position 1 of prompt 1 \(of 2\) is out of range"):
        model.run_with_cache({"input_ids": bad, "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])}, "resid_post.0")


def test_capture_only_plans_give_each_row_its_own_forward(model):
    a, b = [5, 9, 14, 3, 8], [7, 2, 11]
    ids = torch.tensor([a, [0, 0] + b])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    _, cache = model.run_with_cache({"input_ids": ids, "attention_mask": mask}, "resid_post.1")
    _, alone_a = model.run_with_cache([a], "resid_post.1")
    _, alone_b = model.run_with_cache([b], "resid_post.1")
    got = cache["resid_post.1"]
    torch.testing.assert_close(got[0], alone_a["resid_post.1"][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1, 2:], alone_b["resid_post.1"][0], atol=1e-5, rtol=1e-4)
    assert bool((got[1, :2] == 0).all())  # padded positions hold 0
