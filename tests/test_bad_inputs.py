"""A sweep of bad inputs across the library: each gives a clear error naming the culprit, and
nothing changes -- no weight, no optimizer state, no file on disk.

Why one module: the checks that an error is raised and says the right thing live beside each
feature's tests; this is the one place that also checks, for every case, the second half of
the contract (DESIGN.md: "before any weight changes"). Each table row is (id, trigger,
expected error type, substrings the message must contain). Areas: Pipeline construction,
``step``/``evaluate`` inputs, ``engine.optim`` options, checkpoint files and state dicts, the
command line (exit status, one line on stderr, the run folder byte for byte), and
multi-process start-up under gloo (one spawn runs all of its cases).
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import engine
import engine.optim as eo
from engine import Pipeline
from engine.__main__ import main
from engine.errors import (
    CheckpointError,
    NonFiniteLossError,
    NotFlushedError,
    PipelineConfigError,
    PipelineInputError,
)

mse = nn.functional.mse_loss


def sgd(p: Any) -> torch.optim.Optimizer:
    return eo.SGD(p, lr=0.1, momentum=0.9)


def stages(S: int = 3, width: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(4, width), nn.Tanh())]
    out += [nn.Sequential(nn.Linear(width, 4), nn.Tanh()) for _ in range(S - 2)]
    return out + [nn.Linear(4, 1)]


def seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def params_of(obj: Any) -> list[torch.Tensor]:
    mods = obj if isinstance(obj, list | tuple) else [obj]
    return [t.detach().clone() for m in mods for t in m.state_dict().values()]


def snapshot(pipe: Pipeline) -> list[Any]:
    """Weights, optimizer state (tensors and numbers) and step/update counts of a pipeline."""
    out: list[Any] = [pipe.steps]
    for st in pipe.stages:
        out += [t.detach().clone() for t in st.module.state_dict().values()]
        if st.optimizer is not None:
            out.append(copy.deepcopy(st.optimizer.state_dict()))
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def expect(trigger: Callable[[], Any], exc: type[BaseException], needles: tuple[str, ...]) -> None:
    with pytest.raises(exc) as info:
        trigger()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"


# ------------------------------------------------------------------ Pipeline construction

C = PipelineConfigError
CONSTRUCTION: list[tuple[str, dict[str, Any], type[BaseException], tuple[str, ...]]] = [
    ("schedule-name", dict(schedule="zigzag"), C, ("unknown schedule 'zigzag'", "1f1b")),
    ("schedule-type", dict(schedule=3), C, ("schedule must be", "got int")),
    ("chunks-zero", dict(chunks=0), C, ("chunks must be >= 1, got 0",)),
    ("chunks-float", dict(chunks=2.5), C, ("chunks must be an int, got 2.5",)),
    ("chunks-missing", dict(chunks=None), C, ("needs chunks=M",)),
    ("update-size-zero", dict(schedule="pb", update_size=0), C, ("update_size must be >= 1, got 0",)),
    ("update-size-sync", dict(schedule="gpipe", update_size=1), C, ("update_size must equal chunks",)),
    ("2bw-chunks", dict(schedule="2bw", chunks=2), C, ("2bw needs chunks >= stages",)),
    ("order-name", dict(schedule="pb", order="zigzag"), C, ("not 'zigzag'",)),
    ("order-sync", dict(schedule="gpipe", order="1f1b"), C, ("runs in order 'fill-drain', not '1f1b'",)),
    ("prediction-name", dict(schedule="pb", weight_prediction="magic"), C, ("weight_prediction='magic'",)),
    ("prediction-stash", dict(schedule="pipedream", weight_prediction="lwp"), C, ("already uses stashed weights",)),
    ("prediction-sync", dict(schedule="gpipe", weight_prediction="spectrain"), C, ("has no delay",)),
    ("prediction-no-momentum", dict(schedule="pb", weight_prediction="lwp",
                                    optimizer=lambda p: eo.SGD(p, lr=0.1)), C, ("prediction='linear'",)),
    ("spectrain-momentum-form", dict(schedule="pb", weight_prediction="spectrain",
                                     optimizer=lambda p: eo.SGD(p, lr=0.1, momentum=0.9, prediction="momentum")),
     C, ("SpecTrain", "prediction='linear'")),
    ("t2-sync", dict(schedule="gpipe", discrepancy_correction=True), C, ("invalid with schedule 'gpipe'",)),
    ("two-mitigations", dict(schedule="pb", weight_prediction="lwp", discrepancy_correction=True,
                             optimizer=lambda p: eo.SGD(p, lr=0.1, momentum=0.9, prediction="linear")), C,
     ("at most one backward-weight mitigation",)),
    ("correction-decay", dict(schedule="pb", correction_decay=2.0), C, ("correction_decay=2.0",)),
    ("checkpoint-mode", dict(checkpoint="sometimes"), C, ("checkpoint='sometimes'",)),
    ("on-nonfinite", dict(on_nonfinite="ignore"), C, ("on_nonfinite='ignore'",)),
    ("transport-name", dict(transport="mpi"), C, ("transport='mpi' is not available",)),
    ("transport-no-procs", dict(transport="gloo"), C, ("transport='gloo' needs one process per stage",)),
    ("data-parallel-zero", dict(data_parallel=0), C, ("data_parallel=0",)),
    ("data-parallel-local", dict(data_parallel=2), C, ("data_parallel=2 needs one process",)),
    ("timeout", dict(timeout=0), C, ("timeout=0 must be a positive number",)),
    ("cuda-streams-cpu", dict(cuda_streams=True), C, ("cuda_streams=True needs", "cpu")),
    ("l2-fraction", dict(l2_persistence=2.0), C, ("l2_persistence=2.0",)),
    ("trace", dict(trace="yes"), C, ("trace='yes' must be True or False",)),
    ("loss-fn", dict(loss_fn=None), C, ("loss_fn must be callable, got NoneType",)),
    ("optimizer-type", dict(optimizer=5), C, ("optimizer must be callable, got int",)),
    ("optimizer-returns-none", dict(optimizer=lambda p: None), C,
     ("stage 0: the optimizer factory returned NoneType",)),
    ("optimizer-foreign-params", dict(optimizer=lambda p: eo.SGD([nn.Parameter(torch.ones(2))], lr=0.1)), C,
     ("stage 0", "not one of the parameters the pipeline passed")),
    ("lr-scheduler", dict(lr_scheduler=5), C, ("lr_scheduler must be a callable",)),
    ("unknown-keyword", dict(chunk=2), TypeError, ("chunk",)),
]


def _other_stages(kind: str) -> Any:
    if kind == "empty":
        return []
    if kind == "not-a-module":
        return [nn.Linear(4, 4), "x", nn.Linear(4, 1)]
    shared = nn.Linear(4, 4)
    return [shared, shared, nn.Linear(4, 1)]


@pytest.mark.parametrize("kw,exc,needles", [c[1:] for c in CONSTRUCTION], ids=[c[0] for c in CONSTRUCTION])
def test_pipeline_construction(kw: dict[str, Any], exc: type[BaseException], needles: tuple[str, ...]) -> None:
    mods = stages()
    before = params_of(mods)
    args = dict(schedule="1f1b", chunks=4, loss_fn=mse, optimizer=sgd) | kw
    expect(lambda: Pipeline(mods, **args), exc, needles)
    assert same(before, params_of(mods))


BALANCE: list[tuple[str, Any, dict[str, Any], tuple[str, ...]]] = [
    ("balance-too-many", seq, dict(balance=[1, 1, 1, 1]), ("balance [1, 1, 1, 1] covers 4 layers but there are 3",)),
    ("balance-too-few", seq, dict(balance=[1, 1]), ("covers 2 layers but there are 3",)),
    ("balance-negative", seq, dict(balance=[2, -1, 2]), ("balance[1] = -1", "stage 1")),
    ("balance-mode", seq, dict(balance="speed"), ("unknown balance 'speed'",)),
    ("balance-needs-sample", seq, dict(balance="time"), ("also pass num_stages=S and sample=",)),
    ("balance-repeats", seq, dict(balance="time", num_stages=2, sample=torch.ones(2, 4), balance_repeats=0),
     ("repeats must be >= 1, got 0",)),
    ("balance-memory-cap", seq, dict(balance="memory", num_stages=2, sample=torch.ones(2, 4), memory_cap_bytes=-5),
     ("memory_cap_bytes must be >= 0, got -5",)),
    ("balance-of-a-list", stages, dict(balance=[1, 1, 1]), ("balance is only used with an nn.Sequential",)),
    ("stages-empty", lambda: _other_stages("empty"), {}, ("stages is empty",)),
    ("stage-not-a-module", lambda: _other_stages("not-a-module"), {}, ("stage 1 is a str",)),
    ("stages-share-a-module", lambda: _other_stages("shared"), {}, ("stage 1 is the module of stage 0",)),
]


@pytest.mark.parametrize("make,kw,needles", [c[1:] for c in BALANCE], ids=[c[0] for c in BALANCE])
def test_stages_and_balance(make: Callable[[], Any], kw: dict[str, Any], needles: tuple[str, ...]) -> None:
    mods = make()
    held = [m for m in (mods if isinstance(mods, list) else [mods]) if isinstance(m, nn.Module)]
    before = params_of(held)
    expect(lambda: Pipeline(mods, schedule="gpipe", chunks=2, loss_fn=mse, optimizer=sgd, **kw), C, needles)
    assert same(before, params_of(held))


@pytest.mark.parametrize("optimizer", [lambda p: eo.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)],
                         ids=["engine.optim", "torch.optim"])
def test_an_integer_parameter_is_named_with_its_stage_whatever_the_optimizer(
    optimizer: Callable[[list[nn.Parameter]], Any],
) -> None:
    """engine.optim refuses an int64 param itself (naming only params[j]); the pipeline checks
    every stage's parameters first, so both optimizers give the stage and the name."""
    mods = stages()
    mods[1].register_parameter("count", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    before = params_of(mods)
    expect(lambda: Pipeline(mods, schedule="1f1b", chunks=2, loss_fn=mse, optimizer=optimizer), C,
           ("stage 1: parameter 'count' has integer/bool dtype torch.int64", "register_buffer"))
    assert same(before, params_of(mods))


# ------------------------------------------------------------------ step() and evaluate() inputs

BAD = PipelineInputError
X, Y = torch.randn(8, 4), torch.randn(8, 1)
STEP: list[tuple[str, Callable[[Pipeline], Any], type[BaseException], tuple[str, ...]]] = [
    ("batch-not-divisible", lambda p: p.step(torch.randn(10, 4), torch.randn(10, 1)), BAD,
     ("batch of 10 samples cannot be split into chunks=4",)),
    ("targets-batch", lambda p: p.step(X, torch.randn(6, 1)), BAD, ("targets have shape",)),
    ("empty-batch", lambda p: p.step(torch.randn(0, 4), torch.randn(0, 1)), BAD, ("the batch is empty (0 samples)",)),
    ("inputs-none", lambda p: p.step(None, Y), BAD, ("inputs hold no tensor", "NoneType")),
    ("inputs-set", lambda p: p.step({X}, Y), BAD, ("inputs hold no tensor", "set")),
    ("inputs-scalar", lambda p: p.step(torch.tensor(1.0), Y), BAD, ("inputs is a scalar",)),
    ("tree-batch-sizes", lambda p: p.step({"a": X, "b": torch.randn(6, 4)}, Y), BAD,
     ("inputs['b'] has 6 samples on dim 0, inputs['a'] has 8",)),
    ("features", lambda p: p.step(torch.randn(8, 3), Y), BAD, ("stage 0", "input micro-batch of shape (2, 3)")),
    ("dtype", lambda p: p.step(X.long(), Y), BAD, ("stage 0", "Long")),
    ("targets-none", lambda p: p.step(X, None), BAD, ("loss_fn cannot compare", "targets None")),
    ("targets-shape", lambda p: p.step(X, torch.randn(8, 3, 2)), BAD, ("loss_fn cannot compare",)),
    ("nonfinite-loss", lambda p: p.step(X, torch.full((8, 1), float("nan"))), NonFiniteLossError,
     ("non-finite loss", "rolled back")),
    ("evaluate-shape", lambda p: p.evaluate(torch.randn(4, 5)), BAD, ("stage 0", "shape (1, 5)")),
    ("evaluate-chunks", lambda p: p.evaluate(X, chunks=0), BAD, ("chunks=0 is invalid",)),
    ("evaluate-empty", lambda p: p.evaluate(torch.randn(0, 4)), BAD, ("empty batch",)),
]


@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
@pytest.mark.parametrize("trigger,exc,needles", [c[1:] for c in STEP], ids=[c[0] for c in STEP])
def test_step_inputs(schedule: str, trigger: Callable[[Pipeline], Any], exc: type[BaseException],
                     needles: tuple[str, ...]) -> None:
    if exc is NonFiniteLossError and schedule == "pb":
        pytest.skip("asynchronous schedules drop the micro-batch instead (test_runtime_errors)")
    pipe = Pipeline(stages(), schedule=schedule, chunks=4, loss_fn=mse, optimizer=sgd)
    pipe.step(X, Y)  # optimizer state exists; pb has micro-batches in flight
    before = snapshot(pipe)
    expect(lambda: trigger(pipe), exc, needles)
    assert same(before, snapshot(pipe))


def test_a_stage_that_cannot_take_its_neighbours_output() -> None:
    mods = [nn.Linear(4, 4), nn.Linear(4, 5), nn.Linear(6, 1)]
    pipe = Pipeline(mods, schedule="1f1b", chunks=2, loss_fn=mse, optimizer=sgd)
    before = snapshot(pipe)
    expect(lambda: pipe.step(torch.randn(4, 4), torch.randn(4, 1)), BAD,
           ("stage 1 outputs shape (2, 5) but stage 2", "in_features=6"))
    assert same(before, snapshot(pipe))


# ------------------------------------------------------------------ engine.optim options


def P() -> list[nn.Parameter]:
    torch.manual_seed(1)
    return [nn.Parameter(torch.randn(3))]


OPTIM: list[tuple[str, Callable[[list[nn.Parameter]], Any], type[BaseException], tuple[str, ...]]] = [
    ("lr", lambda p: eo.SGD(p, lr=-1), ValueError, ("Invalid learning rate: -1",)),
    ("lr-type", lambda p: eo.Adam(p, lr="0.1"), TypeError, ("lr must be a number", "'0.1'")),
    ("momentum", lambda p: eo.SGD(p, lr=0.1, momentum=-0.5), ValueError, ("momentum value: -0.5",)),
    ("delay", lambda p: eo.SGD(p, lr=0.1, delay=1.5), TypeError, ("delay=1.5 is invalid",)),
    ("prediction", lambda p: eo.SGD(p, lr=0.1, momentum=0.9, prediction="cubic"), ValueError,
     ("prediction='cubic' is not a prediction mode",)),
    ("betas", lambda p: eo.Adam(p, betas=(1.0, 0.999)), ValueError, ("beta parameter at index 0: 1.0",)),
    ("eps", lambda p: eo.Adam(p, eps=-1e-8), ValueError, ("eps=-1e-08 is invalid",)),
    ("nesterov", lambda p: eo.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError,
     ("nesterov=True needs momentum > 0 and dampening=0",)),
    ("spike-compensation", lambda p: eo.SGD(p, lr=0.1, spike_compensation="yes"), TypeError,
     ("spike_compensation='yes' is invalid",)),
    ("pipemare-warmup", lambda p: eo.PipeMareLR(eo.SGD(p, lr=0.1), -1), ValueError, ("warmup_steps=-1 is invalid",)),
    ("pipemare-optimizer", lambda p: eo.PipeMareLR(torch.optim.SGD(p, lr=0.1), 5), TypeError,
     ("PipeMareLR needs an engine.optim optimizer",)),
]


@pytest.mark.parametrize("make,exc,needles", [c[1:] for c in OPTIM], ids=[c[0] for c in OPTIM])
def test_optimizer_options(make: Callable[[list[nn.Parameter]], Any], exc: type[BaseException],
                           needles: tuple[str, ...]) -> None:
    params = P()
    before = [p.detach().clone() for p in params]
    expect(lambda: make(params), exc, needles)
    assert same(before, [p.detach() for p in params])


@pytest.mark.parametrize("key,value,needle", [("delay", -1, "param_groups[0]: delay=-1 is invalid"),
                                               ("lr", -1.0, "param_groups[0]: Invalid learning rate")])
def test_an_option_edited_into_a_group_fails_the_step_before_any_change(key: str, value: Any, needle: str) -> None:
    params = P()
    opt = eo.SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(3)
    opt.step()
    opt.param_groups[0][key] = value
    before = [params[0].detach().clone(), copy.deepcopy(opt.state_dict()["state"])]
    expect(opt.step, ValueError, (needle,))
    assert same(before, [params[0].detach(), opt.state_dict()["state"]])


# ------------------------------------------------------------------ checkpoints


def _ckpt_pipe(schedule: str = "1f1b", **kw: Any) -> Pipeline:
    return Pipeline(stages(), schedule=schedule, chunks=4, loss_fn=mse, optimizer=kw.pop("optimizer", sgd), **kw)


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # inside the tensor data: only the checksum can tell
    path.write_bytes(bytes(raw))


def _format_9(path: Path) -> None:
    from test_checkpoint import _rewrite_metadata  # the metadata editor of the checkpoint tests

    _rewrite_metadata(str(path), lambda meta: meta.update(format="engine.pipeline/9"))


#: (id, damage done to the saved file, the pipeline loading it, what the error must say)
DAMAGE: list[tuple[str, Callable[[Path], Any], Callable[[], Pipeline], tuple[str, ...]]] = [
    ("garbage", lambda p: p.write_bytes(b"not a checkpoint at all" * 3), _ckpt_pipe, ("corrupted or truncated",)),
    ("empty", lambda p: p.write_bytes(b""), _ckpt_pipe, ("not even a header",)),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-7]), _ckpt_pipe, ("corrupted or truncated",)),
    ("flipped-byte", _flip, _ckpt_pipe, ("does not match its SHA-256",)),
    ("format-version", _format_9, _ckpt_pipe,
     ("has format 'engine.pipeline/9'",)),
    ("other-optimizer", lambda p: None, lambda: _ckpt_pipe(optimizer=lambda p: eo.AdamW(p, lr=0.1)),
     ("stage 0: the checkpoint's optimizer is engine.optim.sgd.SGD",)),
    ("other-hyperparameters", lambda p: None, lambda: _ckpt_pipe(optimizer=lambda p: eo.SGD(p, lr=0.2, momentum=0.9)),
     ("param_groups[0]['lr']: checkpoint 0.1 vs pipeline 0.2",)),
    ("other-schedule", lambda p: None, lambda: _ckpt_pipe("gpipe"), ("schedule: checkpoint '1f1b' vs pipeline 'gpipe'",)),
    ("other-stage-count", lambda p: None,
     lambda: Pipeline(stages(2), schedule="1f1b", chunks=4, loss_fn=mse, optimizer=sgd),
     ("stages: checkpoint 3 vs pipeline 2",)),
    ("other-shapes", lambda p: None,
     lambda: Pipeline(stages(3, width=5), schedule="1f1b", chunks=4, loss_fn=mse, optimizer=sgd),
     ("stage 0", "in the checkpoint", "in the pipeline")),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    pipe = _ckpt_pipe()
    pipe.step(X, Y)
    path = tmp_path_factory.mktemp("ckpt") / "c.safetensors"
    engine.save(pipe, path)
    return path.read_bytes()


@pytest.mark.parametrize("damage,make,needles", [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_loading_a_bad_checkpoint(saved: bytes, tmp_path: Path, damage: Callable[[Path], Any],
                                  make: Callable[[], Pipeline], needles: tuple[str, ...]) -> None:
    path = tmp_path / "c.safetensors"
    path.write_bytes(saved)
    damage(path)
    on_disk = path.read_bytes()
    pipe = make()
    pipe.step(X, Y)
    before = snapshot(pipe)
    expect(lambda: engine.load(pipe, path), CheckpointError, needles)
    assert same(before, snapshot(pipe)) and path.read_bytes() == on_disk


def test_a_missing_checkpoint_and_a_hand_made_state(tmp_path: Path, saved: bytes) -> None:
    pipe = _ckpt_pipe()
    pipe.step(X, Y)
    before = snapshot(pipe)
    expect(lambda: engine.load(pipe, tmp_path / "missing.safetensors"), CheckpointError, ("cannot read checkpoint",))
    expect(lambda: pipe.load_state_dict({"x": 1}), CheckpointError, ("not a pipeline state",))
    path = tmp_path / "c.safetensors"
    path.write_bytes(saved)
    state = engine.serialization.read_state(path)
    expect(lambda: pipe.load_state_dict(dict(state, steps=-1)), CheckpointError, ("steps=-1 must be an int >= 0",))
    assert same(before, snapshot(pipe)) and not (tmp_path / "missing.safetensors").exists()


def test_saving_unflushed_or_into_a_missing_folder_writes_nothing(tmp_path: Path, saved: bytes) -> None:
    path = tmp_path / "c.safetensors"
    path.write_bytes(saved)
    # pb without recomputation: a forward in flight read weights an update has overwritten
    # since, so it cannot be rebuilt on load (engine.runtime.state.inflight)
    pipe = _ckpt_pipe("pb", checkpoint="never")
    pipe.step(X, Y)
    pipe.step(X, Y)
    before = snapshot(pipe)
    expect(lambda: engine.save(pipe, path), NotFlushedError,
           ("unflushed", "overwritten", "checkpoint='always'", "pipe.flush()"))
    pipe.flush()
    expect(lambda: engine.save(pipe, tmp_path / "nope" / "c.safetensors"), FileNotFoundError, (str(tmp_path / "nope"),))
    assert path.read_bytes() == saved and sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]
    assert pipe.steps == before[0]


def test_a_full_disk_while_saving_is_an_oserror_naming_the_file(
    tmp_path: Path, saved: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports I/O failures as its own error type; save turns them into the OSError
    (errno kept) that a caller handling a full disk catches, and leaves the old file."""
    import errno

    import safetensors.torch

    def full(*a: Any, **k: Any) -> None:
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    path = tmp_path / "c.safetensors"
    path.write_bytes(saved)
    pipe = _ckpt_pipe()
    pipe.step(X, Y)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as info:
        engine.save(pipe, path)
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert path.read_bytes() == saved and [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


# ------------------------------------------------------------------ the command line

TINY = ["--dataset", "iris", "--layers", "4", "--width", "8", "--batch-size", "4", "--evals-per-epoch", "1",
        "--no-progress", "--stages", "2", "--chunks", "2"]


def _corrupt_state(out: Path) -> None:
    (out / "train_state.json").write_text("{not json")


def _other_checkpoint(out: Path) -> None:
    raw = bytearray((out / "checkpoint.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (out / "checkpoint.safetensors").write_bytes(bytes(raw))


CLI: list[tuple[str, list[str], Callable[[Path], None] | None, int, tuple[str, ...]]] = [
    ("schedule", ["train", "--schedule", "zigzag"], None, 2, ("unknown schedule 'zigzag'",)),
    ("chunks", ["train", "--chunks", "0"], None, 2, ("--chunks must be >= 1",)),
    ("momentum", ["train", "--momentum", "1.5"], None, 2, ("--momentum 1.5 must lie in [0, 1)",)),
    ("lr", ["train", "--lr", "nan"], None, 2, ("--lr nan must be a positive number",)),
    ("device", ["train", "--device", "tpu"], None, 2, ("--device 'tpu'",)),
    ("dataset", ["train", "--dataset", "mnist"], None, 2, ("unknown dataset 'mnist'",)),
    ("batch-too-big", ["train", "--batch-size", "100"], None, 2, ("--chunks x --batch-size = 200",)),
    ("update-size-sync", ["train", "--schedule", "gpipe", "--update-size", "3"], None, 2,
     ("--update-size applies to --schedule pipedream and pb only",)),
    ("prediction-sync", ["train", "--schedule", "gpipe", "--prediction", "lwp"], None, 2, ("--schedule pb only",)),
    ("checkpoint-every", ["train", "--checkpoint-every", "0"], None, 2, ("--checkpoint-every must be >= 1",)),
    ("resume-other-options", ["train", "--lr", "0.5", "--resume", "--epochs", "3"], None, 2,
     ("different options", "lr: checkpoint 0.03, now 0.5")),
    ("resume-fewer-epochs", ["train", "--resume", "--epochs", "1"], None, 2,
     ("has trained 2 epochs already; --epochs 1 is below that",)),
    ("resume-corrupt-state", ["train", "--resume", "--epochs", "3"], _corrupt_state, 1,
     ("train_state.json", "unreadable")),
    ("resume-other-checkpoint", ["train", "--resume", "--epochs", "3"], _other_checkpoint, 1,
     ("is not the checkpoint train_state.json names",)),
    ("compare-methods", ["compare", "--methods", "pb,foo"], None, 2, ("unknown method(s) foo",)),
    ("schedule-command", ["schedule", "zigzag"], None, 2, ("unknown schedule 'zigzag'",)),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *TINY, "--epochs", "2", "--out", str(out)]) == 0
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv,damage,code,needles", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_command_line(capsys: pytest.CaptureFixture[str], run_dir: Path, tmp_path: Path, argv: list[str],
                      damage: Callable[[Path], None] | None, code: int, needles: tuple[str, ...]) -> None:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    if damage is not None:
        damage(out)
    before = _files(out)
    capsys.readouterr()
    extra = [*TINY, "--out", str(out)] if argv[0] in ("train", "compare") else []
    got = main([argv[0], *extra, *argv[1:]])
    _, err = capsys.readouterr()
    assert got == code, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert _files(out) == before


# ------------------------------------------------------------------ multi-process start-up


@pytest.mark.distributed
def test_multi_process_starts_that_disagree() -> None:
    from distributed_support import BAD_STARTS, RANKS, spawn

    names = list(BAD_STARTS)
    results = spawn(RANKS, [("bad_starts", dict(S=RANKS, names=names))], timeout=180)
    named = {
        "chunks": "chunks: rank 0 has 4, rank 1 has 2",
        "schedule": "schedule: rank 0 has '1f1b', rank 1 has 'gpipe'",
        "checkpoint": "checkpoint: rank 0 has 'never', rank 1 has 'except_last'",
        "on_nonfinite": "on_nonfinite: rank 0 has 'raise', rank 1 has 'skip'",
        "deferred_batch_norm": "deferred_batch_norm: rank 0 has False, rank 1 has True",
        "spike_compensation": "optimizer mitigations",
        "stage_shapes": "stage 1",
    }
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name in names:
            r = res["bad_starts"][name]
            assert "message" in r, (rank, name, r)  # no message: that start did not fail
            assert r["type"] == ("PipelineInputError" if name == "stage_shapes" else "PipelineConfigError")
            assert named[name] in r["message"], (rank, name, r["message"])
            assert r["unchanged"], (rank, name)
