"""Running the fidelity workflows on a server: the server (``Backend``), the results file
(``Report``) and the task-major loop over a plan of labels (``run_plan``, after ``warm_up``).
``benchmarks.coverage`` runs its workflows through these too."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from tqdm import tqdm

from benchmarks.fidelity.options import REPO, Arm, adapters
from benchmarks.fidelity.records import FailedRun, Run
from benchmarks.fidelity.summary import MethodSummary, aggregate
from benchmarks.fidelity.turns import run_one
from sglang_kvshare.methods import get_method, method_variant
from sglang_kvshare.workflows import http_sender


class Backend:
    """The server: started here (with a dump dir) or attached to (``--server-url``)."""

    def __init__(self, args, workdir: Path, name: str, lr_cache: bool = False, extra_flags: Sequence[str] = ()):
        self.server = None
        if args.server_url:
            self.url = args.server_url
            self.dump_root = Path(args.dump_dir) if args.dump_dir else None
            return
        from sglang_kvshare.assets import ensure_default_model
        from sglang_kvshare.testing.server import kvshare_server

        self.dump_root = workdir / f"dumps-{name}"
        self.log_path = workdir / f"server-{name}.log"
        flags = ["--kvshare-dump-dir", str(self.dump_root), "--max-total-tokens", str(args.max_total_tokens)]
        if args.agents == "lora":
            lora_paths = [f"{n}={p}" for n, p in adapters(args.adapter_targets).items()]
            flags += ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "4"]
            flags += ["--lora-paths", *lora_paths]
        if lr_cache:
            flags.append("--kvshare-lr-cache")
        flags += list(extra_flags)
        print(f"starting server ({name}), log {self.log_path}", flush=True)
        t0 = time.time()
        self.server = kvshare_server(str(ensure_default_model()), self.log_path, *flags, timeout=args.server_timeout)
        self.url = self.server.url
        print(f"server up at {self.url} in {time.time() - t0:.0f}s", flush=True)

    def alive(self) -> bool:
        return self.server is None or self.server.proc.poll() is None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def git_head() -> Optional[str]:
    """The repository's HEAD commit (and whether the tree is dirty), for the record."""
    try:
        git = ["git", "-C", str(REPO)]
        head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(
            git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return head + ("+dirty" if dirty else "") if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def write_results(results: Dict[str, Any], out: Path) -> None:
    """Write the results JSON atomically (a reader never sees half a file)."""
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out)


def jsonable(value: Any) -> Any:
    """``value`` with every typed record in it (anything with ``to_json``) as its JSON dict."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


@dataclass
class Report:
    """A benchmark's results file: ``config`` and ``notes``, then named sections in the order they
    were first set (``<section>_runs``: label -> run records; ``<section>``: label -> summary);
    rewritten whole by every ``save``."""

    out: Path
    config: Dict[str, Any]
    notes: str
    sections: Dict[str, Any] = field(default_factory=dict)

    def runs(self, section: str) -> Dict[str, List[Run]]:
        return self.sections.setdefault(section + "_runs", {})

    def summaries(self, section: str) -> Dict[str, MethodSummary]:
        return self.sections[section]

    def to_json(self) -> Dict[str, Any]:
        return {"config": self.config, "notes": self.notes, **jsonable(self.sections)}

    def save(self) -> None:
        self.config["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_results(self.to_json(), self.out)


def warm_up(args, backend: Backend, tasks, roles, plan: Sequence[Arm], tag: str) -> int:
    """Run the correction methods of ``plan`` over ``tasks`` (distinct from the measured ones),
    unshadowed and unrecorded, so the measured tasks meet warm anchor pools and a settled online
    tau, as a long-running server would; returns the workflows run."""
    send = http_sender(backend.url, timeout=args.request_timeout)
    todo = [a for a in plan if get_method(method_variant(a.method)[0]).corrector is not None]
    bar = tqdm(total=len(tasks) * len(todo), desc="warm-up", unit="wf", dynamic_ncols=True)
    for task in tasks:
        for arm in todo:
            bar.set_postfix_str(f"{arm.label} {task.id}")
            warm = Arm(f"warmup-{arm.label}", arm.method, arm.tau, arm.recompute_ratio)
            run_one(send, task, roles, warm, tag, args.max_new_tokens, False, backend.dump_root, False)
            bar.update(1)
    bar.close()
    return len(tasks) * len(todo)


def run_plan(
    args, backend: Backend, tasks, roles, plan: Sequence[Arm], tag: str, report: Report, section: str, warmup_tasks=()
) -> None:
    """Task-major loop over the arms of ``plan``, after the correction methods' warm-up over
    ``warmup_tasks``; the section's summaries are recomputed and the report saved after every task."""
    if warmup_tasks:
        report.config[section + "_warmup_workflows"] = warm_up(args, backend, warmup_tasks, roles, plan, tag)
    send = http_sender(backend.url, timeout=args.request_timeout)
    runs = report.runs(section)
    bar = tqdm(total=len(tasks) * len(plan), desc=section, unit="wf", dynamic_ncols=True)
    for ti, task in enumerate(tasks):
        for arm in plan:
            shadow = arm.method != "nonshared" or ti < args.sanity_tasks
            bar.set_postfix_str(f"{arm.label} {task.id}")
            try:
                rec = run_one(
                    send, task, roles, arm, tag, args.max_new_tokens, shadow, backend.dump_root, args.keep_dumps
                )
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                rec = FailedRun(task.id, arm.method, arm.tau, arm.label, repr(e))
                tqdm.write(f"[{arm.label} {task.id}] failed: {e!r}")
                if not backend.alive():
                    raise RuntimeError("the server died; see its log") from e
            runs.setdefault(arm.label, []).append(rec)
            bar.update(1)
        report.sections[section] = {label: aggregate(rs) for label, rs in runs.items()}
        report.save()
    bar.close()
