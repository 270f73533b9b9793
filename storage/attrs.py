"""Every user-attribute key of a study and of its trials: the study's persistent schema, renamed here or nowhere
(docs/decisions.md, "Attribute keys live in storage/attrs.py"). A run's figures are stored under the field names
of trainer/report.py ``Figures`` and stats.py ``Speed``, not literal keys."""

from __future__ import annotations

# -- the study's (search/study/studies.py writes them when it creates or resumes the study)
SPEC = "hpsearch_spec"  # the study's spec as a dict: what every worker trains
N_TRIALS = "hpsearch_n_trials"  # the trial budget, as `start --n-trials` last set it
DEADLINE = "hpsearch_deadline"  # database-clock time (s) after which no new trial starts, or None
UID = "hpsearch_uid"  # a random id per study, also in its folder's marker (rundir.py): whose folder is whose
MEMORY_PLAN = "hpsearch_memory_plan"  # the last start/worker's memory plan (search/study/plan.py): line, terms
WARM_START = "hpsearch_warm_start"  # what [search] warm_start did as the study was created: its source and counts
SPEC_TABLE = "spec: "  # + a spec table's name ("search.space"): that table in one line, for the dashboard

# -- a trial's, written by the worker that runs it (search/workers/worker.py)
ENQUEUED = "enqueued"  # True on a trial the spec fixed the parameters of (search/study/studies.py)
WARM_START_OF = "warm_start_of"  # on a trial a warm start queued: the earlier trial it repeats, "STUDY#N"
EARLIER_RESULT = "earlier_result"  # on a COMPLETE trial copied from a warm start for the sampler ("STUDY#N"): it
# never ran here, and no count, best or retention of this study includes it (search/study/warm_start.py ran_here)
DEVICE = "device"  # the device it ran on, as "cuda:1 (NVIDIA H200)" or "cpu"
HOST = "host"  # the host it ran on: its checkpoints are on that host's disk
WORKER = "worker"  # the worker's name, host/device/pid
THREADS = "torch_threads"  # the CPU threads its attempt trained with (torch.get_num_threads)
DEVICE_SECONDS = "device_seconds"  # device time of all its attempts together (x devices): the gpu_hours budget
FAIL_REASON = "fail_reason"  # why it failed or was pruned other than by the pruner ("oom", "worker_lost", ...)

# -- a trial's, from what the trainer reported (search/workers/trial_attrs.py)
BEST_CHECKPOINT = "best_checkpoint"  # path of its best model, trial-N/best: stays that path once the folder is gone
BEST_CHECKPOINT_MB = "best_checkpoint_mb"  # its size on disk in MiB (an adapter: megabytes, not gigabytes)
BEST_STEP = "best_step"  # the optimizer step of its best validation point
BEST_VAL = "best_val_"  # + a validation metric's name (loss, accuracy, f1, perplexity): its value at the best point
BEST_LOSS = BEST_VAL + "loss"  # breaks ties of the objective (storage/retention.py rank)
RESUME_CHECKPOINT = "resume_checkpoint"  # path of its latest resumable state, trial-N/resume/state.pt (stays too)
RESUMED_FROM_STEP = "resumed_from_step"  # the step a retry's training resumed at
SPEED = "train_samples_per_second"  # the one figure (``Speed`` field) that status shows
TRAINABLE = "trainable_parameters"  # the ``Figures`` field a trainable_parameters objective reads (objectives.py)
HELD = "held_mb"  # the ``Figures`` field set beside the memory plan (planned vs measured, in `status`)
PEAK_MEMORY = "peak_memory_mb"  # the ``Speed`` field a peak_memory_gb objective reads (search/study/objectives.py)
POINTS = "validation_points"  # a two-objective study's {step: quality objective}: Optuna keeps none there

# -- why a trial's checkpoint is gone (storage/deletions.py, the one writer): read as a trial's attribute, stored as
# the study's under ``deleted_key`` (Optuna takes no attribute on a finished trial: docs/decisions.md)
BEST_CHECKPOINT_DELETED = BEST_CHECKPOINT + "_deleted"  # e.g. "not in the study's top 2"; absent while it is there
RESUME_CHECKPOINT_DELETED = RESUME_CHECKPOINT + "_deleted"  # e.g. "trial complete", "taken over by its retry, ..."


def deleted_key(number: int, key: str) -> str:
    """The study attribute that says trial ``number``'s ``key`` (a ``*_DELETED`` key above) and why."""
    return f"trial {number}: {key}"


# -- a retry's, written by search/workers/retry.py hand_back as it queues one
RETRY_OF = "retry_of"  # the number of the trial it retries
RETRY_COUNT = "retry_count"  # how many times that trial has been retried, this one included
RESUME_FROM = "resume_from"  # the failed attempt's resumable state to continue from, or ""
