"""Muon: Newton-Schulz against references and invariants, block views, the optimizer's contract.

References: ``torch.optim.Muon`` (bf16 Newton-Schulz, whole matrices), a direct fp32 evaluation
of the update formulas written out block by block here, ``torch.optim.AdamW`` for the AdamW
groups, and ``torch.utils.flop_counter`` for the FLOP formula. Invariants: the singular values
of a first update, zero and missing gradients, non-finite gradients changing nothing.
``ShardedMuon`` on plain tensors (no process group) must equal ``Muon``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from etude.model.meta import ParamMeta
from etude.optim import (
    POLAR_EXPRESS_COEFFICIENTS,
    QUINTIC_COEFFICIENTS,
    Muon,
    ShardedMuon,
    merge_blocks,
    ns_flops,
    split_blocks,
    update_scale,
    zeropower_via_newtonschulz,
)

LR, WD, MU = 0.02, 0.1, 0.95


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# (meta, parameter shape): one of each block kind, rectangular blocks (well conditioned)
LAYOUTS = {
    "q": (ParamMeta(kind="heads_dim0", num_blocks=4), (4 * 8, 32)),  # 4 heads [8, 32]
    "o": (ParamMeta(kind="heads_dim1", num_blocks=4), (32, 4 * 8)),  # 4 heads [32, 8]
    "experts": (ParamMeta(kind="experts", num_blocks=3), (3, 12, 40)),
    "wide": (ParamMeta(kind="matrix"), (16, 48)),
    "tall": (ParamMeta(kind="matrix"), (40, 10)),
}


def layout_params(seed: int = 0) -> dict[str, nn.Parameter]:
    return {
        name: nn.Parameter(gaussian(*shape, seed=seed + i) * 0.1)
        for i, (name, (_, shape)) in enumerate(LAYOUTS.items())
    }


def muon_groups(params: dict[str, nn.Parameter]) -> list[dict]:
    return [{"params": [params[name]], "meta": meta} for name, (meta, _) in LAYOUTS.items()]


def direct_blocks(x: torch.Tensor, meta: ParamMeta) -> list[tuple[torch.Tensor, tuple]]:
    """Each block of ``x`` and the index that selects it, by explicit slicing (no views)."""
    m, n = meta.block_shape(tuple(x.shape))
    out = []
    for b in range(meta.num_blocks):
        if meta.kind == "heads_dim0":
            index = (slice(b * m, (b + 1) * m), slice(None))
        elif meta.kind == "heads_dim1":
            index = (slice(None), slice(b * n, (b + 1) * n))
        elif meta.kind == "experts":
            index = (b,)
        else:
            index = (slice(None), slice(None))
        out.append((x[index], index))
    return out


def direct_newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration on one 2-D block, written out."""
    a, b, c = QUINTIC_COEFFICIENTS
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / max(X.norm().item(), 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


# --- Newton-Schulz -------------------------------------------------------------------------


def test_matches_torch_muon_with_bf16_newton_schulz():
    torch.manual_seed(0)
    shapes = [(32, 48), (64, 16), (24, 24)]
    for adjust in ("match_rms_adamw", "original"):
        start = [gaussian(*s, seed=i) for i, s in enumerate(shapes)]
        ref_params = [nn.Parameter(w.clone()) for w in start]
        our_params = [nn.Parameter(w.clone()) for w in start]
        ref = torch.optim.Muon(ref_params, lr=LR, weight_decay=WD, momentum=MU, adjust_lr_fn=adjust)
        ours = Muon(
            [{"params": our_params}],
            lr=LR,
            weight_decay=WD,
            momentum=MU,
            ns_dtype="bfloat16",
            adjust_lr=adjust,
        )
        for step in range(5):
            for i, (a, b) in enumerate(zip(ref_params, our_params)):
                g = gaussian(*a.shape, seed=100 * step + i)
                a.grad, b.grad = g.clone(), g.clone()
            ref.step()
            ours.step()
        for a, b, w in zip(ref_params, our_params, start):
            assert (a - w).abs().max() > 1e-2  # the parameters moved
            # one bf16 rounding of the orthogonal update (2^-8 relative) per step at most
            torch.testing.assert_close(
                b, a, rtol=0, atol=5 * 2**-8 * LR * update_scale(*a.shape, adjust)
            )


def test_fp32_matches_direct_evaluation_block_by_block():
    params = layout_params()
    start = {name: p.detach().clone() for name, p in params.items()}
    opt = Muon(muon_groups(params), lr=LR, weight_decay=WD, momentum=MU, ns_dtype="float32")
    want = {name: p.clone() for name, p in start.items()}
    bufs = {name: torch.zeros_like(p) for name, p in start.items()}
    for step in range(3):
        for i, (name, p) in enumerate(params.items()):
            g = gaussian(*p.shape, seed=10 * step + i)
            p.grad = g.clone()
            meta = LAYOUTS[name][0]
            bufs[name] = MU * bufs[name] + (1 - MU) * g
            u = (1 - MU) * g + MU * bufs[name]
            new = want[name] * (1 - LR * WD)
            for block, index in direct_blocks(u, meta):
                m, n = block.shape
                new[index] -= LR * 0.2 * max(m, n) ** 0.5 * direct_newton_schulz(block)
            want[name] = new
        opt.step()
    for name, p in params.items():
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_first_update_has_singular_values_in_the_quintic_band():
    params = layout_params()
    start = {name: p.detach().clone() for name, p in params.items()}
    opt = Muon(muon_groups(params), lr=LR, weight_decay=0.0, momentum=MU, ns_dtype="float32")
    for i, p in enumerate(params.values()):
        p.grad = gaussian(*p.shape, seed=50 + i)
    opt.step()
    for name, p in params.items():
        meta = LAYOUTS[name][0]
        delta = p.detach() - start[name]
        for block, _ in direct_blocks(delta, meta):
            m, n = block.shape
            s = torch.linalg.svdvals(block.double()) / (LR * update_scale(m, n, "match_rms_adamw"))
            assert s.numel() == min(m, n)
            assert 0.5 < s.min() and s.max() < 1.5, (name, s)


def test_polar_express_converges_to_the_polar_factor():
    G_NMK = gaussian(6, 12, 40)
    loose = torch.linalg.svdvals(
        zeropower_via_newtonschulz(G_NMK, 5, "polar_express", torch.float32)
    )
    assert 0.8 < loose.min() and loose.max() < 1.15  # tighter than the quintic's [0.68, 1.13]
    tight = torch.linalg.svdvals(
        zeropower_via_newtonschulz(G_NMK, 10, "polar_express", torch.float32)
    )
    torch.testing.assert_close(tight, torch.ones_like(tight), rtol=0, atol=1e-3)
    U, _, Vh = torch.linalg.svd(G_NMK.double(), full_matrices=False)
    polar = zeropower_via_newtonschulz(G_NMK, 10, "polar_express", torch.float32).double()
    torch.testing.assert_close(polar, U @ Vh, rtol=0, atol=1e-3)
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 8 and POLAR_EXPRESS_COEFFICIENTS[-1] == (
        1.875,
        -1.25,
        0.375,
    )


def test_batched_iteration_equals_blocks_one_at_a_time():
    G_NMK = gaussian(5, 24, 9)  # tall: transposed inside
    batched = zeropower_via_newtonschulz(G_NMK, dtype=torch.float32)
    for k in range(5):
        torch.testing.assert_close(batched[k], direct_newton_schulz(G_NMK[k]), rtol=1e-5, atol=1e-6)
    assert zeropower_via_newtonschulz(G_NMK[0], dtype=torch.float32).shape == (24, 9)
    assert zeropower_via_newtonschulz(torch.zeros(0, 3, 4)).shape == (0, 3, 4)


def test_dtype_is_a_setting_with_float32_default_on_cpu():
    G_NMK = gaussian(2, 8, 16)
    assert zeropower_via_newtonschulz(G_NMK).dtype == torch.float32
    assert zeropower_via_newtonschulz(G_NMK, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_ns_flops_counts_the_matmuls():
    for m, n, steps in [(8, 32, 5), (40, 10, 5), (12, 12, 3)]:
        with FlopCounterMode(display=False) as counter:
            zeropower_via_newtonschulz(gaussian(3, m, n), steps, dtype=torch.float32)
        assert counter.get_total_flops() == 3 * ns_flops(m, n, steps)


def test_zero_block_stays_zero():
    for coefficients in ("quintic", "polar_express"):
        out = zeropower_via_newtonschulz(torch.zeros(2, 4, 6), coefficients=coefficients)
        assert torch.equal(out, torch.zeros(2, 4, 6))


def test_unknown_settings_name_the_fix():
    with pytest.raises(ValueError, match="ns_coefficients"):
        zeropower_via_newtonschulz(gaussian(1, 2, 2), coefficients="cubic")
    with pytest.raises(ValueError, match="adjust_lr"):
        update_scale(4, 4, "sqrt")
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([nn.Parameter(gaussian(4, 4))], ns_dtype="float16")


def test_update_scale_options():
    assert update_scale(64, 256, "match_rms_adamw") == pytest.approx(0.2 * 16)
    assert update_scale(256, 64, "original") == pytest.approx(2.0)
    assert update_scale(64, 256, "original") == 1.0


# --- block views ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_split_blocks_are_views_that_merge_back(name):
    meta, shape = LAYOUTS[name]
    x = gaussian(*shape)
    blocks_NMK = split_blocks(x, meta)
    assert blocks_NMK.shape == (meta.num_blocks, *meta.block_shape(shape))
    assert blocks_NMK.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    for k, (block, _) in enumerate(direct_blocks(x, meta)):
        assert torch.equal(blocks_NMK[k], block)
    assert torch.equal(merge_blocks(blocks_NMK, meta), x)
    assert torch.equal(merge_blocks(blocks_NMK.contiguous(), meta), x)
    blocks_NMK[-1].fill_(7.0)  # writing the view writes the parameter
    assert torch.equal(direct_blocks(x, meta)[-1][0], torch.full_like(blocks_NMK[-1], 7.0))


# --- optimizer contract --------------------------------------------------------------------


def test_adamw_groups_match_torch_adamw():
    start = [gaussian(30, 8), gaussian(8, seed=1)]
    ref_params = [nn.Parameter(w.clone()) for w in start]
    our_params = [nn.Parameter(w.clone()) for w in start]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    ours = Muon(
        [{"params": our_params, "algorithm": "adamw", "weight_decay": 0.05}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for step in range(4):
        for i, (a, b) in enumerate(zip(ref_params, our_params)):
            g = gaussian(*a.shape, seed=7 * step + i)
            a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    for a, b in zip(ref_params, our_params):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert ours.state[our_params[0]].keys() == ref.state[ref_params[0]].keys()


def mixed_optimizer(params: dict[str, nn.Parameter], cls=Muon, **kw) -> torch.optim.Optimizer:
    norm = params.setdefault("norm", nn.Parameter(torch.ones(8)))
    groups = muon_groups(params) + [{"params": [norm], "algorithm": "adamw"}]
    return cls(groups, lr=LR, weight_decay=WD, momentum=MU, **kw)


def step_all(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter], step: int) -> None:
    for i, p in enumerate(params.values()):
        p.grad = gaussian(*p.shape, seed=1000 * step + i)
    opt.step()


def test_state_dict_round_trip_continues_exactly():
    a = layout_params()
    opt_a = mixed_optimizer(a)
    for step in range(2):
        step_all(opt_a, a, step)
    saved_params = {k: p.detach().clone() for k, p in a.items()}
    saved_state = copy.deepcopy(opt_a.state_dict())
    for step in range(2, 4):
        step_all(opt_a, a, step)

    b = {k: nn.Parameter(v.clone()) for k, v in saved_params.items()}
    opt_b = mixed_optimizer(b)
    opt_b.load_state_dict(saved_state)
    assert (
        opt_b.param_groups[0]["kind"] == "heads_dim0" and opt_b.param_groups[0]["num_blocks"] == 4
    )
    for step in range(2, 4):
        step_all(opt_b, b, step)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)


def test_zero_gradients_give_no_nan():
    params = layout_params()
    start = {k: p.detach().clone() for k, p in params.items()}
    opt = Muon(muon_groups(params), lr=LR, weight_decay=WD)
    for p in params.values():
        p.grad = torch.zeros_like(p)
    opt.step()
    for k, p in params.items():
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.detach(), start[k] * (1 - LR * WD), rtol=0, atol=0)


def test_none_gradient_is_skipped():
    params = layout_params()
    opt = mixed_optimizer(params)
    start = {k: p.detach().clone() for k, p in params.items()}
    for i, (k, p) in enumerate(params.items()):
        p.grad = None if k in ("o", "norm") else gaussian(*p.shape, seed=i)
    opt.step()
    for k in ("o", "norm"):
        assert torch.equal(params[k].detach(), start[k]) and not opt.state[params[k]]
    assert not torch.equal(params["q"].detach(), start["q"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_raises_and_changes_nothing(bad):
    params = layout_params()
    opt = mixed_optimizer(params)
    step_all(opt, params, 0)
    before_params = {k: p.detach().clone() for k, p in params.items()}
    before_state = copy.deepcopy(opt.state_dict())
    for i, p in enumerate(params.values()):
        p.grad = gaussian(*p.shape, seed=i)
    params["experts"].grad[1, 2, 3] = bad
    with pytest.raises(FloatingPointError, match=r"params'\]\[0\]|experts") as info:
        opt.step()
    assert "param_groups[2]" in str(info.value)  # the experts group, named without names
    for k, p in params.items():
        assert torch.equal(p.detach(), before_params[k])
    after = opt.state_dict()["state"]
    for key, state in before_state["state"].items():
        for name, value in state.items():
            assert torch.equal(after[key][name], value)


def test_named_parameters_name_the_bad_gradient():
    w = nn.Parameter(gaussian(4, 6))
    opt = Muon([{"params": [("layers.0.attention.q_proj.weight", w)]}])
    w.grad = torch.full_like(w, float("nan"))
    with pytest.raises(FloatingPointError, match="layers.0.attention.q_proj.weight"):
        opt.step()


def test_groups_without_metadata_are_refused_for_non_matrices():
    with pytest.raises(ValueError, match="no block metadata"):
        Muon([nn.Parameter(gaussian(2, 3, 4))])
    with pytest.raises(ValueError, match="does not split into 5 heads_dim0 blocks"):
        Muon([{"params": [nn.Parameter(gaussian(12, 4))], "kind": "heads_dim0", "num_blocks": 5}])
    with pytest.raises(ValueError, match="not a Muon kind"):
        Muon([{"params": [nn.Parameter(gaussian(12, 4))], "kind": "norm", "num_blocks": 1}])
    with pytest.raises(ValueError, match="momentum"):
        Muon([nn.Parameter(gaussian(4, 4))], momentum=1.0)


def test_closure_loss_is_returned():
    w = nn.Parameter(gaussian(4, 6))
    opt = Muon([w])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx((gaussian(4, 6) ** 2).sum().item())


def test_sharded_muon_without_process_group_equals_muon():
    a, b = layout_params(), layout_params()
    ref = mixed_optimizer(a)
    ours = mixed_optimizer(b, cls=ShardedMuon, bucket_mb=0.001)
    for step in range(3):
        step_all(ref, a, step)
        step_all(ours, b, step)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7, msg=k)
    assert ours.stats["collectives"] == 0 and ours.stats["bytes_sent"] == 0
    assert ours.stats["buckets"] > len(LAYOUTS)  # small buckets split parameters
    want_flops = sum(
        meta.num_blocks * ns_flops(*meta.block_shape(shape), 5) for meta, shape in LAYOUTS.values()
    )
    assert ours.stats["ns_flops"] == want_flops
