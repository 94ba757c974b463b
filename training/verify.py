"""Compare the best committed checkpoints of two trial directories, tensor by tensor.

`python -m training.verify ORIGINAL_CHECKPOINTS REBUILT_CHECKPOINTS` prints a JSON
verdict; used by `trainyard reproduce`, which keeps torch out of the orchestrator.
`python -m training.verify --check CHECKPOINTS` only loads the best checkpoint, so
reproduce can refuse a tampered one before it retrains.

Checkpoints are read as data (`training.checkpointing.safe_load`): one holding
pickled code is refused, with `"refused": true` and the reason in `"error"`, and
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

import torch

from training.checkpointing import CheckpointStore, UnsafeCheckpointError


def compare(original_uri: str, rebuilt_uri: str, atol: float = 0.0) -> dict[str, Any]:
    original = CheckpointStore(original_uri).best()
    rebuilt = CheckpointStore(rebuilt_uri).best()
    if original is None or rebuilt is None:
        missing = original_uri if original is None else rebuilt_uri
        return {"identical": False, "detail": f"no committed best checkpoint under {missing}"}
    a, b = original.state["state_dict"], rebuilt.state["state_dict"]
    if a.keys() != b.keys():
        return {"identical": False, "detail": f"different tensors: {sorted(set(a) ^ set(b))[:5]}"}
    differing = {}
    for k in a:
        same = torch.equal(a[k], b[k]) if atol == 0 else torch.allclose(a[k], b[k], atol=atol, rtol=0)
        if not same:
            differing[k] = float((a[k].float() - b[k].float()).abs().max())
    return {
        "identical": not differing,
        "tensors": len(a),
        "original": original.uri,
        "rebuilt": rebuilt.uri,
        "steps": [original.step, rebuilt.step],
        "max_abs_difference": differing,
        "tolerance": atol,
        "detail": (f"{'bitwise identical' if atol == 0 else f'within {atol}'} ({len(a)} tensors, step {original.step})"
                   if not differing else f"{len(differing)} of {len(a)} tensors differ, e.g. {next(iter(differing))}"),
    }


def check(uri: str) -> dict[str, Any]:
    """Whether the best committed checkpoint under `uri` loads (as data); the verdict says which one."""
    best = CheckpointStore(uri).best()
    if best is None:
        return {"ok": False, "detail": f"no committed best checkpoint under {uri}"}
    return {"ok": True, "checkpoint": best.uri, "step": best.step, "detail": f"{best.uri} loads as plain data"}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.verify", description=__doc__.splitlines()[0])
    parser.add_argument("original")
    parser.add_argument("rebuilt", nargs="?")
    parser.add_argument("--atol", type=float, default=0.0, help="tolerance (GPU runs); 0 = bitwise")
    parser.add_argument("--check", action="store_true", help="only load ORIGINAL's best checkpoint")
    args = parser.parse_args(argv)
    if not args.check and args.rebuilt is None:
        parser.error("REBUILT is required unless --check is given")
    try:
        verdict = check(args.original) if args.check else compare(args.original, args.rebuilt, args.atol)
    except UnsafeCheckpointError as e:
        print(json.dumps({"ok": False, "identical": False, "refused": True, "error": str(e), "detail": str(e)}))
        return 2
    print(json.dumps(verdict))
    return 0 if verdict.get("identical", verdict.get("ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
