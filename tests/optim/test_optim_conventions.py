"""torch.optim conventions kept by engine.optim: state_dict, schedulers, add_param_group,
zero_grad, closure, params without grads, zero-size params, AMP, and bad input rejected
with a clear message before any weight or state changes."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

import engine.optim as eo


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1, bias=False)).to(dtype)


def batches(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 7, generator=g).to(dtype) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().sin().sum()


def train(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor], sched=()) -> None:
    for x in xs:
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()
        for s in sched:
            s.step()


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ----------------------------------------------------------------------------- state_dict

MITIGATED = [
    (eo.SGD, dict(lr=0.03, momentum=0.9, delay=2, spike_compensation=True, prediction="linear",
                  discrepancy_correction=True, correction_decay=0.2)),
    (eo.Adam, dict(lr=0.01, amsgrad=True, delay=3, spike_compensation=True, prediction="momentum",
                   discrepancy_correction=True)),
    (eo.AdamW, dict(lr=0.01, delay=2, prediction="linear", prediction_horizon=5)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,cfg", MITIGATED)
def test_state_dict_round_trip_continues_identically(cls, cfg: dict, dtype: torch.dtype) -> None:
    xs = batches(8, dtype=dtype)
    a = make_model(dtype=dtype)
    opt_a = cls(a.parameters(), **cfg)
    train(a, opt_a, xs[:4])
    saved = roundtrip(opt_a.state_dict())

    b = make_model(dtype=dtype)
    b.load_state_dict(a.state_dict())
    opt_b = cls(b.parameters(), lr=0.5)  # different settings: all must come from the state_dict
    opt_b.load_state_dict(saved)
    for key in ("delay", "spike_compensation", "prediction", "prediction_horizon", "discrepancy_correction", "correction_decay"):
        assert opt_b.param_groups[0][key] == opt_a.param_groups[0][key]
    # state stays fp32 whatever the param dtype (torch's loader would cast it to bf16)
    for p in b.parameters():
        for key, value in opt_b.state[p].items():
            assert value.dtype == torch.float32, key
        if cfg.get("prediction") and cls is not eo.SGD:
            assert "last_update" in opt_b.state[p]
    # predictions and backward weights are available right after loading, and equal
    for u, v in zip(opt_a.predicted_weights(), opt_b.predicted_weights(), strict=True):
        assert torch.equal(u, v)
    for u, v in zip(opt_a.backward_weights(), opt_b.backward_weights(), strict=True):
        assert torch.equal(u, v)

    train(a, opt_a, xs[4:])
    train(b, opt_b, xs[4:])
    assert params_equal(a, b)
    for u, v in zip(opt_a.predicted_weights(), opt_b.predicted_weights(), strict=True):
        assert torch.equal(u, v)
    for u, v in zip(opt_a.backward_weights(), opt_b.backward_weights(), strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("ours_cls,torch_cls,cfg", [
    (eo.SGD, torch.optim.SGD, dict(lr=0.03, momentum=0.9)),
    (eo.Adam, torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
])
def test_loads_a_torch_optim_state_dict(ours_cls, torch_cls, cfg: dict) -> None:
    xs = batches(6)
    ref = make_model()
    ref_opt = torch_cls(ref.parameters(), foreach=False, **cfg)
    train(ref, ref_opt, xs[:3])
    ours = make_model()
    ours.load_state_dict(ref.state_dict())
    our_opt = ours_cls(ours.parameters())
    our_opt.load_state_dict(roundtrip(ref_opt.state_dict()))
    assert our_opt.param_groups[0]["delay"] == 0  # missing engine options filled from defaults
    train(ref, ref_opt, xs[3:])
    train(ours, our_opt, xs[3:])
    assert params_equal(ref, ours)


# ----------------------------------------------------------------------------- schedulers


def test_step_lr_and_one_cycle_match_torch() -> None:
    xs = batches(12)
    for ours_cls, torch_cls, cfg in [(eo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                                     (eo.Adam, torch.optim.Adam, dict(lr=0.01))]:
        ref, ours = make_model(), make_model()
        ref_opt = torch_cls(ref.parameters(), foreach=False, **cfg)
        our_opt = ours_cls(ours.parameters(), **cfg)

        def scheds(o):
            return [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
                    torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20)]

        # OneCycleLR owns lr (and momentum/betas) absolutely; StepLR multiplies what it sees
        train(ref, ref_opt, xs, scheds(ref_opt)[1:])
        train(ours, our_opt, xs, scheds(our_opt)[1:])
        assert params_equal(ref, ours)
        train(ref, ref_opt, xs, scheds(ref_opt)[:1])
        train(ours, our_opt, xs, scheds(our_opt)[:1])
        assert params_equal(ref, ours)


# ----------------------------------------------------------------------------- groups, grads


def test_add_param_group_uses_defaults_and_matches_torch() -> None:
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref[0].parameters(), lr=0.03, momentum=0.9, foreach=False)
    our_opt = eo.SGD(ours[0].parameters(), lr=0.03, momentum=0.9, delay=2)
    ref_opt.add_param_group({"params": list(ref[2].parameters()) + list(ref[3].parameters()), "lr": 0.01})
    our_opt.add_param_group({"params": list(ours[2].parameters()) + list(ours[3].parameters()), "lr": 0.01, "delay": 0})
    assert our_opt.param_groups[1]["momentum"] == 0.9 and our_opt.param_groups[1]["delay"] == 0
    assert our_opt.param_groups[0]["delay"] == 2
    xs = batches(5)
    train(ref, ref_opt, xs)
    train(ours, our_opt, xs)
    assert params_equal(ref, ours)


def test_add_param_group_rejects_bad_group_without_adding_it() -> None:
    model = make_model()
    opt = eo.SGD(model[0].parameters(), lr=0.03, momentum=0.9)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: delay=-2 is invalid"):
        opt.add_param_group({"params": model[2].parameters(), "delay": -2})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": model[2].parameters(), "delay": 2})  # the params are still free
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none: bool) -> None:
    model = make_model()
    opt = eo.Adam(model.parameters())
    train(model, opt, batches(1))
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()


def test_closure_is_evaluated_with_grad_and_loss_returned() -> None:
    ref, ours = make_model(), make_model()
    x = batches(1)[0]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=False)
    our_opt = eo.SGD(ours.parameters(), lr=0.1)

    def closure_for(model, opt):
        def closure():
            opt.zero_grad()
            loss = loss_of(model, x)
            loss.backward()
            return loss
        return closure

    for _ in range(3):
        l_ref = ref_opt.step(closure_for(ref, ref_opt))
        l_ours = our_opt.step(closure_for(ours, our_opt))
        assert torch.equal(l_ref, l_ours)
    assert params_equal(ref, ours)


@pytest.mark.parametrize("cls", [eo.SGD, eo.Adam])
def test_params_without_grads_are_skipped_and_zero_size_params_work(cls) -> None:
    torch.manual_seed(0)
    used = nn.Parameter(torch.randn(3, 2))
    unused = nn.Parameter(torch.randn(4))
    empty = nn.Parameter(torch.zeros(0, 3))
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    opt = cls([used, unused, empty, frozen], lr=0.1, weight_decay=0.1, **({"momentum": 0.9} if cls is eo.SGD else {}))
    before = unused.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        (used.sum() + empty.sum()).backward()
        opt.step()
    assert torch.equal(unused, before) and unused not in opt.state
    assert frozen not in opt.state
    assert empty in opt.state and empty.shape == (0, 3)
    if cls is eo.Adam:
        assert opt.state[empty]["step"].item() == 3  # torch advances the count of empty params too
    assert len(opt.predicted_weights()) == 3  # params that require grad: used, unused, empty


# ----------------------------------------------------------------------------- AMP


@pytest.mark.parametrize("ours_cls,torch_cls", [(eo.SGD, torch.optim.SGD), (eo.Adam, torch.optim.Adam)])
def test_grad_scaler_matches_torch_and_skips_inf_steps(ours_cls, torch_cls) -> None:
    assert ours_cls._step_supports_amp_scaling
    cfg = dict(lr=0.02, momentum=0.9) if ours_cls is eo.SGD else dict(lr=0.01)
    ref, ours = make_model(), make_model()
    ref_opt = torch_cls(ref.parameters(), foreach=False, **cfg)
    our_opt = ours_cls(ours.parameters(), **cfg)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    xs = batches(6)
    for i, x in enumerate(xs):
        for model, opt, scaler in ((ref, ref_opt, scalers[0]), (ours, our_opt, scalers[1])):
            opt.zero_grad()
            loss = loss_of(model, x) * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert params_equal(ref, ours), i
        assert not hasattr(our_opt, "found_inf")  # GradScaler removed what it set
    assert scalers[0].get_scale() == scalers[1].get_scale()
    if ours_cls is eo.Adam:
        assert our_opt.state[next(ours.parameters())]["step"].item() == 5  # inf step skipped


@pytest.mark.parametrize("cls", [eo.SGD, eo.AdamW])
def test_explicit_grad_scale_and_found_inf(cls) -> None:
    a, b = make_model(), make_model()
    opt_a, opt_b = cls(a.parameters(), lr=0.01), cls(b.parameters(), lr=0.01)
    x = batches(1)[0]
    loss_of(a, x).backward()
    (loss_of(b, x) * 8).backward()
    opt_a.step()
    opt_b.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(0.0))
    assert params_equal(a, b)
    snapshot = copy.deepcopy(opt_b.state_dict())
    weights = [p.detach().clone() for p in b.parameters()]
    opt_b.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(1.0))
    assert all(torch.equal(p, w) for p, w in zip(b.parameters(), weights, strict=True))
    after = opt_b.state_dict()["state"]
    for pid, entry in snapshot["state"].items():
        for key, value in entry.items():
            assert torch.equal(after[pid][key], value)


# ----------------------------------------------------------------------------- bad input

P = lambda: [nn.Parameter(torch.ones(3))]  # noqa: E731

BAD_CONSTRUCTORS = [
    (lambda: eo.SGD(P(), lr=-0.1), ValueError, r"Invalid learning rate: -0\.1.*>= 0"),
    (lambda: eo.SGD(P(), lr=torch.tensor([0.1, 0.2])), ValueError, r"Tensor lr must be 1-element"),
    (lambda: eo.Adam(P(), lr=torch.tensor(0.1), foreach=True), ValueError,
     r"lr as a Tensor is not supported for capturable=False and foreach=True"),
    (lambda: eo.SGD(P(), delay=-1), ValueError, r"delay=-1 is invalid.*>= 0"),
    (lambda: eo.SGD(P(), delay=1.5), TypeError, r"delay=1\.5 is invalid.*int"),
    (lambda: eo.SGD(P(), momentum=-0.5), ValueError, r"Invalid momentum value: -0\.5"),
    (lambda: eo.SGD(P(), momentum=0.9, dampening="x"), TypeError, r"dampening='x' is invalid"),
    (lambda: eo.SGD(P(), momentum=1.5, spike_compensation=True, delay=2), ValueError,
     r"spike_compensation=True needs momentum <= 1 \(got 1\.5\)"),
    (lambda: eo.SGD(P(), weight_decay=-1), ValueError, r"Invalid weight_decay value: -1"),
    (lambda: eo.SGD(P(), fused=True, differentiable=True), RuntimeError, r"`fused` does not support `differentiable`"),
    (lambda: eo.AdamW(P(), fused=True, foreach=True), RuntimeError, r"`fused` and `foreach` cannot be `True` together"),
    (lambda: eo.Adam(P(), betas=(0.9, torch.tensor(0.99))), ValueError, r"betas must be either both floats or both Tensors"),
    (lambda: eo.Adam(P(), betas=(torch.tensor([0.9, 0.8]), torch.tensor(0.99))), ValueError, r"Tensor betas\[0\] must be 1-element"),
    (lambda: eo.SGD([nn.Parameter(torch.ones(3, dtype=torch.int32), requires_grad=False)]), TypeError,
     r"params\[0\] is torch\.int32; params must be float32, float64"),
    (lambda: eo.SGD(P(), momentum=0.9, dampening=0.1, nesterov=True), ValueError, r"nesterov=True needs momentum > 0 and dampening=0"),
    (lambda: eo.SGD(P(), momentum=0.9, nesterov=True, spike_compensation=True, delay=1), ValueError,
     r"spike_compensation=True cannot be combined with nesterov=True.*D=1 \*is\* the Nesterov"),
    (lambda: eo.SGD(P(), prediction="linear"), ValueError, r"prediction='linear' needs momentum > 0.*nothing\s+to extrapolate"),
    (lambda: eo.SGD(P(), momentum=0.9, prediction="cubic"), ValueError, r"prediction='cubic' is not a prediction mode; valid values are None, 'linear', 'momentum'"),
    (lambda: eo.Adam(P(), prediction="nesterov"), ValueError, r"valid values are None, 'linear', 'momentum'"),
    (lambda: eo.SGD(P(), momentum=0.9, prediction="momentum", prediction_horizon=1.5), ValueError, r"prediction_horizon=1\.5 is invalid for prediction='momentum'"),
    (lambda: eo.Adam(P(), prediction="linear", prediction_horizon=-1), ValueError, r"prediction_horizon=-1 is invalid"),
    (lambda: eo.Adam(P(), discrepancy_correction=True, correction_decay=1.0), ValueError, r"correction_decay=1\.0 is invalid.*\(0, 1\)"),
    (lambda: eo.Adam(P(), betas=(1.0, 0.999)), ValueError, r"Invalid beta parameter at index 0: 1\.0.*\[0, 1\)"),
    (lambda: eo.AdamW(P(), betas=(0.9, -0.1)), ValueError, r"Invalid beta parameter at index 1: -0\.1"),
    (lambda: eo.Adam(P(), eps=-1e-8), ValueError, r"eps=-1e-08 is invalid"),
    (lambda: eo.Adam(P(), fused="yes"), ValueError, r"fused='yes' is invalid"),
    (lambda: eo.SGD([{"params": P()}, {"params": P(), "delay": -3}]), ValueError, r"param_groups\[1\]: delay=-3 is invalid"),
]


@pytest.mark.parametrize("ctor,exc,message", BAD_CONSTRUCTORS)
def test_bad_constructor_arguments(ctor, exc, message: str) -> None:
    with pytest.raises(exc, match=message):
        ctor()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()["state"])


def _assert_unchanged(model: nn.Module, opt: torch.optim.Optimizer, snap) -> None:
    weights, state = snap
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for pid, entry in state.items():
        for key, value in entry.items():
            assert torch.equal(now[pid][key], value), (pid, key)


@pytest.mark.parametrize("cls", [eo.SGD, eo.Adam])
@pytest.mark.parametrize("key,value,message", [
    ("delay", -1, r"param_groups\[1\]: delay=-1 is invalid"),
    ("lr", -1.0, r"param_groups\[1\]: Invalid learning rate: -1\.0"),
    ("prediction", "quadratic", r"param_groups\[1\]: prediction='quadratic' is not a prediction mode"),
])
def test_bad_group_option_at_step_changes_nothing(cls, key: str, value, message: str) -> None:
    """A group edited into a bad state (e.g. by a pipeline or scheduler) fails the whole step
    before group 0 is touched."""
    model = make_model()
    opt = cls([{"params": model[0].parameters()}, {"params": list(model[2].parameters()) + list(model[3].parameters())}],
              lr=0.01, **({"momentum": 0.9} if cls is eo.SGD else {}))
    train(model, opt, batches(2))
    loss_of(model, batches(1, seed=9)[0]).backward()
    opt.param_groups[1][key] = value
    snap = _snapshot(model, opt)
    with pytest.raises((ValueError, TypeError), match=message):
        opt.step()
    _assert_unchanged(model, opt, snap)


@pytest.mark.parametrize("cls,kw,message", [
    (eo.Adam, {}, "Adam does not support sparse gradients, please consider torch.optim.SparseAdam"),
    (eo.SGD, {"momentum": 0.9, "spike_compensation": True, "delay": 2},
     "spike_compensation need dense gradients"),
    (eo.SGD, {"momentum": 0.9, "prediction": "linear"}, "prediction need dense gradients"),
])
def test_sparse_gradient_names_the_param_and_changes_nothing(cls, kw, message: str) -> None:
    """Adam refuses sparse gradients as torch does; SGD takes them (torch's sparse update) but
    not with a mitigation, which needs the dense gradient."""
    torch.manual_seed(0)
    dense = nn.Linear(3, 2)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = cls([{"params": dense.parameters()}, {"params": emb.parameters()}], lr=0.1, **kw)
    (dense(emb(torch.tensor([1, 4]))).sum()).backward()
    weights = [p.detach().clone() for p in [*dense.parameters(), *emb.parameters()]]
    with pytest.raises(RuntimeError, match=re.escape("param_groups[1]['params'][0] has a sparse gradient")) as err:
        opt.step()
    assert message in str(err.value)
    assert all(torch.equal(p, w) for p, w in zip([*dense.parameters(), *emb.parameters()], weights, strict=True))
    assert len(opt.state) == 0
