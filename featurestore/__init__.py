"""The Feast side of trainyard's feature-store sources: runs only in the Feast interpreter (`.venv-feast`).

Feast pins pandas below 3 and tenacity below 9, which the platform's lock does
not allow, so Feast lives in its own virtual environment with its own lock
(`deploy/feast/constraints.txt`). Nothing in the platform imports this
package; `trainyard.data.feast` runs its commands as subprocesses with JSON in
and out, as `trainyard reproduce` runs `python -m training.verify`:

- `python -m featurestore.retrieve`: a point-in-time training set for entity
  rows (a JSON request on stdin, a JSON answer on stdout);
- `python -m featurestore.example`: the example team's feature repository on
  local files, with generated data (for `make demo` and the tests).
"""
