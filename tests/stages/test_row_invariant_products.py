"""Deterministic mode's start-up check of the products (stages/row_invariant_products.py), on CPU: it names every
product a model runs (the fused layers' stacked weights included), passes products whose rows never depend on the
row count, and refuses, naming the product and the row counts, where a row's bits move."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from stages import row_invariant_products as rip
from stages.layers import DecoderLayer
from stages.qwen3_tts import Qwen3TTS

ROWS = (1, 2, 3, 8, 17, 40)


def rowwise_linear(x, w, b=None):
    """A product whose every row is computed alone: row-invariant by construction."""
    out = torch.stack([torch.mv(w, row) for row in x]) if len(x) else x.new_zeros(0, w.shape[0])
    return out + b if b is not None else out


def batch_dependent_linear(x, w, b=None):
    """A product whose rounding moves with the row count (as a split-K choice by M does)."""
    out = rowwise_linear(x, w, b)
    return out + 1e-3 if len(x) <= 8 else out


@pytest.fixture()
def small_rows(monkeypatch):
    monkeypatch.setattr(rip, "CHECK_ROWS", ROWS)


def test_product_shapes_name_the_fused_products(tiny_custom_voice):
    talker = Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False).talker
    before = rip.product_shapes(talker)
    linears = {(m.out_features, m.in_features, m.bias is not None) for m in talker.modules() if isinstance(m, nn.Linear)}
    assert linears < before, "the fused layers' stacked products are named before the layers are fused"
    layers = [m for m in talker.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.fuse_projections()
    stacked = {(w.shape[0], w.shape[1], False) for layer in layers for w in (layer.qkv_weight, layer.gate_up_weight)}
    assert rip.product_shapes(talker) == before == linears | stacked


def test_a_rowwise_product_passes(monkeypatch, small_rows):
    monkeypatch.setattr(rip.F, "linear", rowwise_linear)
    assert rip.differing_rows(24, 16, True, ROWS, torch.device("cpu"), torch.float32) == []
    rip.check(nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8, bias=False)), (4, 16), torch.device("cpu"),
              torch.float32)


def test_a_product_whose_rows_move_with_the_row_count_is_refused(monkeypatch, small_rows):
    monkeypatch.setattr(rip.F, "linear", batch_dependent_linear)
    assert rip.differing_rows(24, 16, False, ROWS, torch.device("cpu"), torch.float32) == [1, 2, 3, 8]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "a test device")
    with pytest.raises(rip.ProductsNotRowInvariant, match=r"24 x 16 at \[1, 2, 3, 4, 8\] rows.*CUBLAS_WORKSPACE_CONFIG"):
        rip.check(nn.Linear(16, 24, bias=False), (4,), torch.device("cpu"), torch.float32)


def test_no_workspace_is_asked_of_cublas(monkeypatch):
    monkeypatch.delenv(rip.WORKSPACE_ENV, raising=False)
    rip.use_no_workspace()
    assert os.environ[rip.WORKSPACE_ENV] == ":0:0"
