"""The training loop, for real on CPU: accumulation equivalence, checkpoints, resume, NaN."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpsearch.search.workers.trial_attrs import AttrReporter
from hpsearch.storage.trialdir import RESUME, RESUME_FILE
from hpsearch.trainer import loop, step as trainer_step
from hpsearch.trainer.checkpoint import load_resume, record_out_of_memory
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.model import PretrainedCache, load_tokenizer
from tests.support.tiny import build_tiny_bert, files_in, train_tiny

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Dropout would make two forward passes differ; accumulation must be compared without it.
    return build_tiny_bert(tmp_path_factory.mktemp("m") / "model", dropout=0.0)


@pytest.fixture(scope="module")
def prepared(no_dropout_model: Path, demo_files: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    tok = load_tokenizer(str(no_dropout_model))
    return tok, prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)


def test_accumulation_matches_one_big_batch(no_dropout_model: Path, prepared, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = TrainConfig(
        learning_rate=1e-3,
        batch_size=32,
        epochs=1,
        max_steps=1,
        eval_every=1,
        precision="fp32",
        group_by_length=False,
        max_grad_norm=0.0,
    )
    big, _, _ = train_tiny(no_dropout_model, prepared, replace(base, micro_batch_size=32), tmp_path / "a")
    acc, _, _ = train_tiny(no_dropout_model, prepared, replace(base, micro_batch_size=8), tmp_path / "b")
    init = PretrainedCache().fresh(str(no_dropout_model), 2, {0: "negative", 1: "positive"}, 0)
    moved = 0
    for (name, p_big), (_, p_acc), (_, p0) in zip(
        big.named_parameters(), acc.named_parameters(), init.named_parameters(), strict=False
    ):
        torch.testing.assert_close(p_acc, p_big, rtol=1e-5, atol=1e-6, msg=name)
        moved += int(not torch.equal(p_big, p0))
    assert moved > 10, "the update must actually change the parameters"


def _oom_above(monkeypatch: pytest.MonkeyPatch, limit: int) -> list[int]:
    """Inject CUDA's out-of-memory error for micro-batches larger than ``limit`` (CPU has none). As on a GPU, the
    passes are padded micro-batches, not packed (packing.py is for CPUs)."""
    monkeypatch.setattr(trainer_step.packing, "packs", lambda *_: False)
    sizes: list[int] = []
    real = trainer_step.collate

    def collate(data, indices, pad_id):  # type: ignore[no-untyped-def]
        sizes.append(len(indices))
        if len(indices) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(data, indices, pad_id)

    monkeypatch.setattr(trainer_step, "collate", collate)
    return sizes


def test_out_of_memory_halves_the_micro_batch_and_trains_the_same(  # type: ignore[no-untyped-def]
    no_dropout_model: Path, prepared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = TrainConfig(
        learning_rate=1e-3,
        batch_size=24,
        micro_batch_size=24,
        epochs=1,
        max_steps=3,
        eval_every=3,
        precision="fp32",
        group_by_length=False,
        max_grad_norm=0.0,
    )
    whole, _, _ = train_tiny(no_dropout_model, prepared, base, tmp_path / "a")
    sizes = _oom_above(monkeypatch, 5)
    halved, result, rep = train_tiny(no_dropout_model, prepared, base, tmp_path / "b")
    assert result.status == "complete" and result.steps == 3
    # 24 -> 12 -> 6 -> 3: accumulation 8 keeps the effective batch at 24.
    assert rep.attrs["micro_batch_size"] == 3 and rep.attrs["accumulation_steps"] == 8
    assert sizes[:3] == [24, 12, 6] and set(sizes[3:]) <= {3, 6}, "validation runs at twice the micro-batch"
    for (name, p_whole), (_, p_halved) in zip(whole.named_parameters(), halved.named_parameters(), strict=True):
        torch.testing.assert_close(p_halved, p_whole, rtol=1e-4, atol=1e-5, msg=name)


def test_out_of_memory_at_micro_batch_one_fails_with_reason(  # type: ignore[no-untyped-def]
    no_dropout_model: Path, prepared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _oom_above(monkeypatch, 0)
    cfg = TrainConfig(learning_rate=1e-3, batch_size=8, micro_batch_size=8, max_steps=2, precision="fp32")
    _, result, _ = train_tiny(no_dropout_model, prepared, cfg, tmp_path / "t")
    assert result.status == "failed" and result.fail_reason == "oom" and result.steps == 0


@pytest.mark.parametrize(("ran_out", "micro"), [(24, 12), (1, None)])
def test_a_recorded_out_of_memory_starts_the_run_smaller_or_fails_it(  # type: ignore[no-untyped-def]
    no_dropout_model: Path, prepared, tmp_path: Path, ran_out: int, micro: int | None
) -> None:
    """What a rank of a device group records when it runs out of memory (trainer/loop.py ``fit``), read back by
    the group's retry: it starts at the halved micro-batch, or fails at once when micro-batch 1 ran out."""
    cfg = TrainConfig(
        learning_rate=1e-3, batch_size=24, micro_batch_size=24, max_steps=2, eval_every=2, precision="fp32"
    )
    files = files_in(tmp_path / "t")
    record_out_of_memory(files.out_of_memory, ran_out, step=1, rank=1)
    _, result, rep = train_tiny(no_dropout_model, prepared, cfg, tmp_path / "t")
    if micro is None:
        assert result.status == "failed" and result.fail_reason == "oom" and result.steps == 0
        return
    assert result.status == "complete" and result.steps == 2
    assert rep.attrs["micro_batch_size"] == micro and rep.attrs["accumulation_steps"] == 24 // micro


def test_checkpoint_saved_and_resume_continues(tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path) -> None:
    tok = load_tokenizer(str(tiny_model))
    data = prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)
    prepared = (tok, data)
    cfg = TrainConfig(learning_rate=2e-3, batch_size=32, micro_batch_size=16, epochs=2, eval_every=5, precision="fp32")
    # Stop after the second validation point, as SIGTERM would.
    calls = {"n": 0}

    def stop_after_step_10() -> bool:
        calls["n"] += 1
        return calls["n"] >= 10

    _, first, _ = train_tiny(tiny_model, prepared, cfg, tmp_path / "t0", should_stop=stop_after_step_10)
    assert first.status == "interrupted" and first.steps == 10
    state_file = tmp_path / "t0" / RESUME / RESUME_FILE
    state = load_resume(state_file)
    assert state["step"] == 10 and "optimizer" in state and "scheduler" in state and "rng" in state
    assert (tmp_path / "t0" / "best" / "config.json").exists()

    _, resumed, rep = train_tiny(tiny_model, prepared, cfg, tmp_path / "t1", resume_from=state_file)
    assert resumed.status == "complete"
    assert sorted(rep.values) == [15, 20], "the resumed run continues at step 10, it does not restart"
    # Its folder has no best model of steps 5-10 (nobody moved t0's there): the best point
    # starts over, so the value it ends with is one whose model it saved.
    assert resumed.best_step in (15, 20) and rep.attrs["best_step"] == resumed.best_step
    assert json.loads((tmp_path / "t1" / "best" / "hpsearch.json").read_text())["step"] == resumed.best_step

    # The resumed run ends where an uninterrupted run ends (same data order, RNG and schedule).
    _, _straight, rep_straight = train_tiny(tiny_model, prepared, cfg, tmp_path / "t2")
    assert rep.values[20] == pytest.approx(rep_straight.values[20], rel=1e-4)


def test_resume_keeps_the_best_model_it_was_given(
    tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """A retry gets the interrupted attempt's best model in its folder (the worker moves it):
    when no later point beats it, that model and its step are the retry's best, on record."""
    tok = load_tokenizer(str(tiny_model))
    data = prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)
    cfg = TrainConfig(learning_rate=2e-3, batch_size=32, micro_batch_size=16, epochs=2, eval_every=5, precision="fp32")
    calls = {"n": 0}

    def stop_after_step_10() -> bool:
        calls["n"] += 1
        return calls["n"] >= 10

    train_tiny(tiny_model, (tok, data), cfg, tmp_path / "t0", should_stop=stop_after_step_10)
    retry = tmp_path / "t1"
    retry.mkdir()
    shutil.move(tmp_path / "t0" / "best", retry / "best")
    meta_file = retry / "best" / "hpsearch.json"
    meta = json.loads(meta_file.read_text())
    # A loss no later point can beat stands in for "the best came before the interruption".
    meta_file.write_text(json.dumps({**meta, "val_loss": 0.0}))
    state_file = tmp_path / "t0" / RESUME / RESUME_FILE
    _, resumed, rep = train_tiny(tiny_model, (tok, data), cfg, retry, resume_from=state_file)
    assert resumed.status == "complete" and sorted(rep.values) == [15, 20]
    assert (resumed.best_value, resumed.best_step) == (0.0, meta["step"])
    assert rep.attrs["best_step"] == meta["step"] and rep.attrs["best_val_loss"] == 0.0
    assert rep.attrs["best_checkpoint"] == str((retry / "best").resolve())
    assert json.loads(meta_file.read_text())["val_loss"] == 0.0, "no later point replaced it"


def test_an_accuracy_tie_between_points_goes_to_the_lower_loss(
    no_dropout_model: Path, prepared, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The best point is the most accurate one and, among equally accurate ones, the one with the
    lowest validation loss, not merely the first: its model, step and loss are what is kept."""
    cfg = TrainConfig(
        learning_rate=1e-2, batch_size=32, micro_batch_size=32, epochs=4, eval_every=2, precision="fp32", seed=2
    )
    _, result, rep = train_tiny(no_dropout_model, prepared, cfg, tmp_path / "acc", metric="accuracy")
    # The same run, deterministic on CPU, reporting its loss at the same points.
    _, _, losses = train_tiny(no_dropout_model, prepared, cfg, tmp_path / "loss")
    assert sorted(losses.values) == sorted(rep.values), "both runs validated at the same steps"
    top = max(rep.values.values())
    tied = [step for step, acc in sorted(rep.values.items()) if acc == top]
    lowest = min(tied, key=lambda step: losses.values[step])
    assert len(tied) > 1 and lowest != tied[0], f"the run must end in a tie the first point does not win: {tied}"
    assert (result.best_step, result.best_value) == (lowest, top)
    assert rep.attrs["best_step"] == lowest and rep.attrs["best_val_loss"] == losses.values[lowest]
    assert json.loads((tmp_path / "acc" / "best" / "hpsearch.json").read_text())["step"] == lowest


def test_nan_loss_prunes_with_reason(tiny_model: Path, prepared, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = TrainConfig(
        learning_rate=1e6,
        batch_size=32,
        micro_batch_size=32,
        epochs=1,
        eval_every=2,
        precision="fp32",
        max_grad_norm=0.0,
    )
    _, result, _ = train_tiny(tiny_model, prepared, cfg, tmp_path / "nan")
    assert result.status == "pruned" and result.fail_reason == "nan_loss"


@pytest.mark.parametrize("minutes,expected", [(0.0, True), (60.0, False)])
def test_resumable_state_is_written_at_most_every_resume_every_minutes(
    tiny_model: Path,
    prepared,
    tmp_path: Path,
    minutes: float,
    expected: bool,  # type: ignore[no-untyped-def]
) -> None:
    cfg = TrainConfig(
        learning_rate=1e-3,
        batch_size=32,
        micro_batch_size=32,
        epochs=1,
        eval_every=2,
        precision="fp32",
        resume_every_minutes=minutes,
    )
    _, result, _ = train_tiny(tiny_model, prepared, cfg, tmp_path / "r")
    assert result.status == "complete"
    assert (tmp_path / "r" / RESUME / RESUME_FILE).exists() is expected


class _HangingReporter(AttrReporter):
    """A search whose storage went silent: report() blocks until the test lets it through
    (or fail, with ``fail``); the rest answers at once."""

    def __init__(self, fail: bool = True, prune: bool = False) -> None:
        import threading

        self.release = threading.Event()
        self.fail, self.prune = fail, prune
        self.values: dict[int, float] = {}
        self.waited_out = False

    def report(self, value: float, step: int, metrics: object = None) -> None:
        self.waited_out = self.waited_out or not self.release.wait(30)
        if self.fail:
            raise ConnectionError("the database stopped answering")
        self.values[step] = value

    def should_prune(self) -> bool:
        return self.prune

    def set_attrs(self, attrs: dict[str, object]) -> None:
        pass


def test_training_goes_on_while_the_search_does_not_answer(
    tiny_model: Path, demo_files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpsearch.trainer import precision
    from hpsearch.trainer.report import StateSavingReporter
    from tests.support.tiny import tiny_run

    monkeypatch.setattr(StateSavingReporter, "ANSWER_S", 0.5)
    inner = _HangingReporter(fail=False)
    steps = {"n": 0}
    step_once = precision.optimizer_step

    def counting_step(*args: object) -> None:
        step_once(*args)  # type: ignore[arg-type]
        steps["n"] += 1
        if steps["n"] == 20:  # the run's last step: only now may the first report (step 5) get through
            inner.release.set()

    monkeypatch.setattr(precision, "optimizer_step", counting_step)
    tok = load_tokenizer(str(tiny_model))
    prepared = (tok, prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None))
    cfg = TrainConfig(learning_rate=2e-3, batch_size=32, micro_batch_size=16, epochs=2, eval_every=5, precision="fp32")
    result = loop.fit(tiny_run(tiny_model, prepared, cfg, tmp_path / "r"), inner)
    assert not inner.waited_out, "the loop stopped at the hung report instead of training on"
    assert result.status == "complete" and steps["n"] == 20
    # fit() returned only once every report had arrived, in order.
    assert list(inner.values) == [5, 10, 15, 20]


def test_a_failed_report_saves_the_state_and_a_good_one_does_not() -> None:
    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.trainer.report import StateSavingReporter

    saved: list[int] = []
    failing = _HangingReporter()
    failing.release.set()
    reporter = StateSavingReporter(failing, lambda: saved.append(1))
    reporter.report(0.5, 10)  # on its way: the failure is raised at the run's next call
    with pytest.raises(ConnectionError):
        reporter.flush()
    with pytest.raises(ConnectionError):
        reporter.report(0.4, 15)  # nothing goes out after a failure
    assert saved == [1]
    fine = StateSavingReporter(NullReporter(), lambda: saved.append(2))
    fine.report(0.25, 20)
    assert fine.should_prune() is False
    fine.flush()
    assert saved == [1]


def test_pruning_is_asked_while_the_search_keeps_up_and_not_when_it_falls_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    from hpsearch.trainer.report import StateSavingReporter

    monkeypatch.setattr(StateSavingReporter, "ANSWER_S", 0.5)
    healthy = _HangingReporter(fail=False, prune=True)
    healthy.release.set()
    reporter = StateSavingReporter(healthy, lambda: "state.pt")
    reporter.report(0.5, 5)
    assert reporter.should_prune() is True  # the pruner's answer, after the report arrived

    stuck = _HangingReporter(fail=False, prune=True)
    reporter = StateSavingReporter(stuck, lambda: "state.pt")
    reporter.report(0.5, 5)
    began = time.monotonic()
    assert reporter.should_prune() is False  # no answer in ANSWER_S: train on
    waited = time.monotonic() - began
    began = time.monotonic()
    reporter.report(0.4, 10)
    assert reporter.should_prune() is False
    assert 0.4 < waited < 2 and time.monotonic() - began < 0.1, "a search known to be behind is not waited for"
    stuck.release.set()
    reporter.flush()
    assert list(stuck.values) == [5, 10]


def test_a_stop_while_the_search_hangs_saves_at_once_and_abandons_the_call_at_the_deadline() -> None:
    import threading
    import time

    from hpsearch.trainer.report import CallAbandoned, StateSavingReporter

    inner, saved, stop, deadline = _HangingReporter(), [], threading.Event(), threading.Event()
    reporter = StateSavingReporter(
        inner, lambda: saved.append(time.monotonic()) or "state.pt", stop.is_set, deadline.is_set
    )
    began = time.monotonic()
    reporter.report(0.5, 10)  # a frozen server: the call never returns (here: not within the test)
    assert time.monotonic() - began < 0.5, "the run does not wait for a report"
    threading.Timer(0.5, stop.set).start()
    threading.Timer(2.0, deadline.set).start()
    with pytest.raises(CallAbandoned):
        reporter.flush()
    # Saved once, soon after the stop, not when the call was given up.
    assert len(saved) == 1 and saved[0] - began < 1.5, [t - began for t in saved]
    assert time.monotonic() - began < 4
    inner.release.set()


def test_an_immediate_reporter_is_called_at_once_on_the_runs_own_thread() -> None:
    import threading

    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.trainer.report import StateSavingReporter

    class Where(NullReporter):
        """Like benchmarks/checkpoint_choice.py's scorer: it must see the model as it is at the call."""

        thread: threading.Thread | None = None

        def report(self, value: float, step: int, metrics: object = None) -> None:
            super().report(value, step)
            self.thread = threading.current_thread()

    inner = Where()
    StateSavingReporter(inner, lambda: "state.pt").report(0.5, 5)
    assert inner.thread is threading.current_thread() and inner.values == {5: 0.5}


def test_a_steps_passes_cast_each_weight_once_and_give_the_same_gradients(  # type: ignore[no-untyped-def]
    no_dropout_model: Path, prepared, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 autocast keeps one region around a step's passes (step._casts_kept): each trained weight is cast to
    16 bits once a step instead of once a pass, and the gradients are those of a region per pass, to the bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpsearch.trainer.distributed import World

    _, data = prepared
    passes = [list(range(0, 16)), list(range(16, 32))]
    monkeypatch.setattr(trainer_step.packing, "packs", lambda *_: False)  # two padded passes, as on a GPU
    model = PretrainedCache().fresh(str(no_dropout_model), 2, {0: "negative", 1: "positive"}, 0)
    weights = {p.data_ptr() for p in model.parameters() if p.ndim == 2}

    class WeightCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in weights:
                WeightCasts.count += 1
            return func(*args, **(kwargs or {}))

    def gradients(kept: bool) -> tuple[list[torch.Tensor], int]:
        model.zero_grad(set_to_none=True)
        WeightCasts.count = 0
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        with WeightCasts():
            if kept:
                trainer_step._accumulate(model, data, passes, 1 / 32, CPU, "bf16", scaler, 16, World(0, 1))
            else:  # a region per pass, as before
                for indices in passes:
                    batch = trainer_step.collate(data.train, indices, data.pad_id)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = trainer_step.tasks.logits(model, batch, data.task)
                    (trainer_step.tasks.loss_sum(logits, batch["labels"], data.task) / 32).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None], WeightCasts.count

    kept, kept_casts = gradients(True)
    per_pass, per_pass_casts = gradients(False)
    assert len(kept) == len(per_pass) > 10
    assert all(torch.equal(a, b) for a, b in zip(kept, per_pass, strict=True))
    assert 0 < kept_casts < per_pass_casts, (kept_casts, per_pass_casts)


def test_a_full_fine_tune_on_a_cpu_draws_its_dropout_masks_with_the_cheaper_dropout(tiny_model: Path) -> None:
    from hpsearch.trainer.dropout import MaskDropout, use_mask_dropout

    model = PretrainedCache().fresh(str(tiny_model), 2, {0: "negative", 1: "positive"}, 0)
    given = {n: m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0}
    keys = set(model.state_dict())
    assert use_mask_dropout(model, torch.device("meta")) == 0  # not a CPU: torch's own (CUDA's is fused, cheap)
    assert use_mask_dropout(model, CPU) == len(given) > 0
    swapped = {n: m for n, m in model.named_modules() if isinstance(m, MaskDropout)}
    assert swapped.keys() == given.keys()
    assert all(m.p == pytest.approx(given[n], abs=1e-5) for n, m in swapped.items())
    assert set(model.state_dict()) == keys  # nothing saved changes
