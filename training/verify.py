"""Compare the best committed checkpoints of two trial directories, tensor by tensor.

`python -m training.verify ORIGINAL_CHECKPOINTS REBUILT_CHECKPOINTS` prints a JSON
verdict; used by `trainyard reproduce`, which keeps torch out of the orchestrator.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

import torch

from training.checkpointing import CheckpointStore


def compare(original_uri: str, rebuilt_uri: str, atol: float = 0.0) -> dict[str, Any]:
    original = CheckpointStore(original_uri, weights_only=False).best()
    rebuilt = CheckpointStore(rebuilt_uri, weights_only=False).best()
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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.verify", description=__doc__.splitlines()[0])
    parser.add_argument("original")
    parser.add_argument("rebuilt")
    parser.add_argument("--atol", type=float, default=0.0, help="tolerance (GPU runs); 0 = bitwise")
    args = parser.parse_args(argv)
    verdict = compare(args.original, args.rebuilt, args.atol)
    print(json.dumps(verdict))
    return 0 if verdict["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
