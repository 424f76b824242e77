"""Run by torchrun in tests/test_distributed_build.py: one rank of several `upcycle()` builds in one job.

Usage: ``torchrun --nproc-per-node 2 tests/ranked_build_worker.py JOBS.json``, JOBS a list of
``{"recipe": {...}, "output": "...", "written": "...", "verify": bool}``. Each rank builds every job in turn (one build after
another within the same torchrun job, as a user's script may) and writes the names of the tensors it wrote
itself (`on_step`) to ``<written>.rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moe_upcycle.build import upcycle


def main(jobs_file: str) -> None:
    rank = int(os.environ["RANK"])
    for job in json.loads(Path(jobs_file).read_text()):
        written: list[str] = []
        result = upcycle(job["recipe"], job["output"], verify=job["verify"],
                         on_step=lambda step, plan: written.append(step.name))
        Path(f"{job['written']}.rank{rank}.json").write_text(json.dumps({
            "written": written, "shards": result.shards, "verified": result.verify and result.verify.ok}))


if __name__ == "__main__":
    main(sys.argv[1])
