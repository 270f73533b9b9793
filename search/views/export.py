"""`hpsearch best --export DIR`: a checked copy of the best trial's checkpoint (a ``save_pretrained`` folder, or an
adapter folder that peft's ``AutoPeftModel*.from_pretrained`` loads) plus the trial's value and parameters; ``merge``
exports an adapter merged into its base instead, a plain ``from_pretrained`` folder."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from hpsearch.search.errors import SpecError
from hpsearch.storage import attrs, registry, regular, rundir, trialdir
from hpsearch.storage.shown import shown
from hpsearch.trainer import adapters
from hpsearch.trainer.checkpoint import META
from hpsearch.trainer.errors import ModelError
from hpsearch.trainer.model import check_weights, load_tokenizer

log = logging.getLogger(__name__)


class ExportError(SpecError):
    """The best model cannot be exported; the message says why and what to do."""


def export_best(
    best: dict[str, Any] | None, study: str, target: Path, uid: str | None = None, *, merge: bool = False
) -> Path:
    """Copy the best trial's checkpoint (``summary.trial_dict``) to ``target``. A checkpoint in a folder marked
    with another ``uid`` than the study's (a study of the same name elsewhere wrote over it) is refused."""
    source, folder = checked_checkpoint(best, study, uid)
    is_adapter = (source / adapters.ADAPTER_CONFIG).exists()  # an adapter's config.json is in its base's folder
    assert best is not None  # checked_checkpoint refused None
    if merge and not is_adapter:
        raise ExportError(
            f"--merge: trial {best['number']}'s checkpoint {source} is a full model, not an adapter; "
            "there is nothing to merge: export it without --merge"
        )
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"--export {target}: exists and is not an empty folder; choose a new folder")
    if target.resolve().is_relative_to(source.resolve().parent):
        # Inside the trial's folder, retention would delete the export with the checkpoint.
        raise ExportError(f"--export {target}: inside trial {best['number']}'s own folder; choose a folder outside it")
    # Copy into a sibling, then rename: an interrupted export never looks complete.
    tmp = target.parent / f".{target.name}.exporting"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        # Held against retention: a better trial finishing now must not delete what is copied.
        with folder.reading():
            if not source.is_dir():
                raise ExportError(
                    f"trial {best['number']}'s checkpoint was deleted by retention as the export began (a better "
                    "trial finished); run `hpsearch best --export` again for the new best"
                )
            if merge:
                _merge(source, tmp)
            else:
                shutil.copytree(source, tmp)
        record = {
            "study": study,
            "trial": best["number"],
            "value": best["value"],
            attrs.BEST_STEP: best.get(attrs.BEST_STEP),
            "params": best.get("params", {}),
        }
        (tmp / "hpsearch_best.json").write_text(json.dumps(record, indent=2, sort_keys=True))
        _follow_umask(tmp)
        if target.exists():
            target.rmdir()
        tmp.rename(target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(
            f"--export {target}: cannot write there ({exc.strerror or exc}); choose a folder you can write to"
        ) from None
    log.info("exported trial %d of %s to %s", best["number"], study, target)
    return target


def checked_checkpoint(best: dict[str, Any] | None, study: str, uid: str | None) -> tuple[Path, trialdir.TrialDir]:
    """The best trial's checkpoint folder and its trial folder, once shown to be what hpsearch wrote for this study
    (``uid``) on this host: a row's path is read, loaded or copied only then (export, ``Search.load_best``)."""
    if best is None:
        raise ExportError(f"study {study!r} has no complete trial yet; nothing to export")
    source_text, gone = best.get(attrs.BEST_CHECKPOINT), best.get(attrs.BEST_CHECKPOINT_DELETED)
    if gone:
        raise ExportError(f"trial {best['number']}'s checkpoint {source_text} was deleted ({gone}); nothing to export")
    if not source_text:
        raise ExportError(f"trial {best['number']} recorded no checkpoint; nothing to export")
    source = Path(source_text)
    if not source.is_dir():
        host = best.get(attrs.HOST)
        if host and host != registry.this_host():
            raise ExportError(
                f"checkpoint {source} of trial {best['number']} is not on this host; run the export on {host}"
            )
        raise ExportError(
            f"checkpoint {source} of trial {best['number']} no longer exists on this host (removed by hand?); "
            "nothing to export"
        )
    folder = trialdir.named_by(source.resolve().parent.parent, source, trialdir.BEST)
    if folder is None or folder.number != best["number"]:
        # The path is a row's word; hpsearch reads only trial-N/best of a study folder it made.
        raise ExportError(
            f"trial {best['number']}'s recorded checkpoint {source} is not trial-{best['number']}/best of an "
            "hpsearch study folder; refusing to read it (someone changed the trial's best_checkpoint)"
        )
    owner = rundir.owner(folder.root)
    if owner is None:
        raise ExportError(
            f"checkpoint {source} is not in a folder an hpsearch study made (no {rundir.MARKER} in "
            f"{folder.root}); refusing to read it"
        )
    if not uid:
        # Every study hpsearch ran has one (`start` and `worker` give it); without it, no folder can be told to be
        # this study's rather than another's that a row points at.
        raise ExportError(
            f"study {study!r} has no {attrs.UID} attribute (someone removed it), so no checkpoint folder can be "
            f"shown to be its own; refusing to export {source}. If {folder.root} is this study's folder, set the "
            f"attribute back to the uid in its {rundir.MARKER}"
        )
    if owner.get("uid") != uid:
        # Named by the folder's own marker (a file, so input: escaped): the study whose folder it is, which is not
        # always one of this name (a row may point into any study's folder).
        theirs, where = shown(owner.get("study", "?")), shown(owner.get("storage", "?"))
        if theirs == study:
            raise ExportError(
                f"checkpoint {source} was overwritten by another study named {study!r} (from {where}); "
                f"it is not trial {best['number']}'s model, and that model is lost"
            )
        raise ExportError(
            f"checkpoint {source} is in the folder of study '{theirs}' (from {where}), not of study {study!r}; "
            f"refusing to export it as trial {best['number']}'s model (someone changed the trial's best_checkpoint)"
        )
    if links := [p for p in source.rglob("*") if p.is_symlink()]:
        # hpsearch writes none: one there was put by someone else, and copying would follow it.
        raise ExportError(f"checkpoint {source} holds a symbolic link ({links[0]}); refusing to export it")
    if odd := [p for p in source.rglob("*") if not (p.is_file() or p.is_dir())]:
        # A FIFO, socket or device: reading or copying it would wait forever (hpsearch writes only plain files).
        raise ExportError(f"checkpoint {source} holds {odd[0]}, which is not a regular file; refusing to export it")
    is_adapter = (source / adapters.ADAPTER_CONFIG).exists()  # an adapter's config.json is in its base's folder
    if not is_adapter and not (source / "config.json").exists():
        raise ExportError(f"checkpoint {source} is incomplete (no config.json)")
    try:
        check_weights(source, f"checkpoint {source} of trial {best['number']}")
    except ModelError as exc:
        raise ExportError(f"{exc}; this copy of trial {best['number']}'s model is lost") from None
    return source, folder


def _follow_umask(folder: Path) -> None:
    """Give the export's files the modes of any file the user makes now: transformers writes model.safetensors
    0600 (through a private temporary file) and copying keeps that, so the weights alone were unreadable to the
    group and others who could read the rest."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():  # a checkpoint holding a link was refused above
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _merge(source: Path, tmp: Path) -> None:
    """The adapter of ``source`` merged into its base, written to ``tmp`` with the tokenizer and meta."""
    meta = json.loads(regular.read_text(source / META, 1 << 20)) if (source / META).exists() else {}
    labels = meta.get("id2label") if isinstance(meta, dict) else None
    id2label = {int(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else None
    problem_type = meta.get("problem_type") if isinstance(meta, dict) else None
    try:
        adapters.merge(
            source, tmp, load_tokenizer(str(source)), id2label, problem_type if isinstance(problem_type, str) else None
        )
    except (OSError, ValueError) as exc:
        # The base the adapter names was moved or deleted since the study ran.
        raise ExportError(f"--merge: cannot load {source} on its base ({str(exc).splitlines()[0]})") from None
    if (source / META).exists():
        shutil.copy2(source / META, tmp / META)
