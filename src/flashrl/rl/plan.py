"""Before a run touches its directory: which checkpoint it resumes, what it would delete, and
whether the resumed checkpoint's config allows this one (nothing here changes what is on disk)."""

from __future__ import annotations

from pathlib import Path

from flashrl.errors import CheckpointError
from flashrl.rl import checkpoint as ckpt
from flashrl.rl.config import RESUME_FREE_FIELDS, TrainConfig
from flashrl.rl.config_build import stored_values


def plan_run(
    config: TrainConfig, out: Path
) -> tuple[Path | None, dict | None, list[tuple[Path, str]], list[Path]]:
    """Check the run directory and the checkpoint to resume before any work; changes nothing on
    disk.

    Returns (checkpoint to resume or None, its trainer state, damaged newer checkpoints that
    `--run.resume latest` skipped, paths `overwrite` deletes)."""
    c = config.run
    if not c.resume:
        if not c.overwrite:
            ckpt.refuse_existing_run(out, overwrite=False)
        return None, None, [], ckpt.run_files(out) if c.overwrite else []
    damaged: list[tuple[Path, str]] = []
    if c.resume == "latest":
        path, state, damaged = ckpt.find_latest(out)
    else:
        path = Path(c.resume)
        state = ckpt.verify_checkpoint(path)
    check_resume_config(config, path, state["config"])
    if path.resolve().parent != out.resolve():
        # resuming another directory's checkpoint: this directory must not hold a run of its own
        if not c.overwrite:
            ckpt.refuse_existing_run(out, overwrite=False)
        return path, state, [], ckpt.run_files(out) if c.overwrite else []
    skipped = {p for p, _ in damaged}
    newer = [
        p for step, p in ckpt.list_checkpoints(out) if step > state["step"] and p not in skipped
    ]
    if newer and not c.overwrite:
        raise CheckpointError(
            f"--run.resume {c.resume}: {', '.join(p.name for p in newer)} of this "
            f"run is newer than {path.name}; resuming from {path.name} would "
            f"discard it: pass --run.overwrite true to delete the newer "
            f"checkpoints, or --run.resume latest"
        )
    check_metrics_present(out, path, state["step"], c.resume)
    return path, state, damaged, newer


def check_metrics_present(out: Path, checkpoint: Path, step: int, resume: str) -> None:
    """A resume into the checkpoint's own directory needs its metrics.jsonl (the history of the
    steps the checkpoint holds): a deleted one is a CheckpointError saying how to go on. An empty
    file is accepted: the resumed run continues without those steps' metrics."""
    metrics = out / ckpt.METRICS_FILE
    if step > 0 and not metrics.exists():
        raise CheckpointError(
            f"--run.resume {resume}: {metrics} is missing, but {checkpoint.name} holds {step} "
            f"trained step(s) whose metrics it recorded. Put the file back; or create it empty "
            f"(touch {metrics}) to resume without the metrics of steps 0-{step - 1}; or start "
            f"over with --run.overwrite true and no --run.resume"
        )


def check_resume_config(config: TrainConfig, path: Path, stored: dict) -> None:
    """CheckpointError naming every field (outside RESUME_FREE_FIELDS and resume_allow_changes)
    whose value differs from the config the checkpoint was trained with."""
    allowed = config.resume_allowed()
    if allowed is None:
        return
    diffs = ckpt.config_differences(
        stored_values(stored, str(path)), config.flat_dict(), set(RESUME_FREE_FIELDS) | allowed
    )
    if diffs:
        names = ",".join(d.split(":")[0] for d in diffs)
        raise CheckpointError(
            f"--run.resume {config.run.resume}: this config differs from the "
            f"one {path} was trained with: {'; '.join(diffs)}. These change "
            f"what the run computes; to continue anyway pass "
            f"--run.resume-allow-changes {names} (free to change: "
            f"{', '.join(RESUME_FREE_FIELDS)})"
        )
