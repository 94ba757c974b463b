"""Optuna's RDBStorage with a faster bulk read of trials (the sweep sensor's cold load).

`RDBStorage._get_trials` loads trials through the ORM (a TrialModel and five
child collections per trial, each row an ORM object) and parses the same
distribution JSON again for every parameter of every trial. A sensor whose
code server restarted reads its whole study that way on its first tick: 22 s
of a 24 s tick at 50k trials here (issue 16). `SweepRDBStorage` reads the
same six tables with plain SELECTs, groups the rows in Python and parses each
distinct distribution once; it builds the same FrozenTrials
(tests/resources/sweeps/test_rdb.py compares them with Optuna's own read on
every kind of trial).

`SweepCachedStorage` is Optuna's cache of finished trials (what a Study wraps
an RDBStorage in) with one addition, `reads_once()`: inside it, this thread
reads the study's trials from the database once and again only after a write
made through this process. One sweep-sensor tick read the same trials 7-8 times
(loading the sampler, the tick's own look, the sweep's status before and after,
the stale-heartbeat check before and after, TPE's search space and its fit):
about 7 ms each at 10,000 trials, each a query for the unfinished trials and a
sort of all of them. A write through this process (a tell, a batch of new
trials, a stale trial failed) bumps `SweepRDBStorage.writes`, and the next read
goes to the database; a write from another process (a run telling its trial)
is seen on the next tick, as if it had landed just after this one's read.

`create_running_trials` writes a tick's new trials (the sweep sensor asks up
to 64 at once) in one transaction: Optuna's `create_new_trial` is a
transaction of ORM round trips per trial (the study row locked, the trial
inserted and flushed, each parameter checked against the study's first use of
its name and inserted, the trial's number counted), 10-20 ms each here, half
of a 64-trial tick at 5,000 trials. The numbers are counted as Optuna counts
them (the trials of the study with a smaller trial id), under the same lock.
Everything else is Optuna's RDBStorage.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import json
import threading
from collections import defaultdict
from typing import Any, Callable, Container, Iterable, Iterator, Optional

import sqlalchemy
import sqlalchemy.exc
from optuna import distributions
from optuna.storages import RDBStorage
from optuna.storages._cached_storage import _CachedStorage
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.trial import FrozenTrial, TrialState

_TRIALS = models.TrialModel.__table__
_PARAMS = models.TrialParamModel.__table__
_VALUES = models.TrialValueModel.__table__
_USER = models.TrialUserAttributeModel.__table__
_SYSTEM = models.TrialSystemAttributeModel.__table__
_INTERMEDIATE = models.TrialIntermediateValueModel.__table__


def _local(utc: Optional[datetime.datetime]) -> Optional[datetime.datetime]:
    """A stored naive-UTC datetime as the naive local time FrozenTrial carries (as TrialModel's properties do)."""
    return None if utc is None else utc.replace(tzinfo=datetime.UTC).astimezone().replace(tzinfo=None)


# RDBStorage's methods that change a study or its trials (BaseStorage's writes, and the batch write below).
_WRITES = ("create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr", "create_new_trial",
           "set_trial_param", "set_trial_state_values", "set_trial_intermediate_value", "set_trial_user_attr",
           "set_trial_system_attr", "create_running_trials")


def _counted(write: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(write)
    def counted(self: "SweepRDBStorage", *args: Any, **kwargs: Any) -> Any:
        try:
            return write(self, *args, **kwargs)
        finally:
            # After the write: a read begun before it is never taken for a later one. Unlocked: two writes at once
            # may add 1 between them, and any change is all a reader looks for.
            self.writes += 1
    return counted


class SweepRDBStorage(RDBStorage):
    """RDBStorage whose `_get_trials` (every bulk read of a study's trials) uses plain SELECTs and that creates a batch
    of running trials in one write.

    Attributes:
        writes: how many writes this process has made through it (any study), for `SweepCachedStorage.reads_once`.
    """

    writes = 0

    def create_running_trials(
        self, study_id: int, params: list[dict[str, Any]], dists: dict[str, distributions.BaseDistribution], *,
        user_attrs: Optional[dict[str, Any]] = None, max_running: Optional[int] = None, max_live: Optional[int] = None,
    ) -> list[FrozenTrial]:
        """One RUNNING trial per parameter set (external values of `dists`), in one transaction; the new trials in
        order.

        What `create_new_trial` with a RUNNING template trial stores, and the
        same checks: each distribution must be compatible with the study's
        earlier use of its parameter name (ValueError otherwise, nothing written).

        Args:
            user_attrs: attributes every new trial carries from the moment it exists (e.g. the run that
                claims it, `resources.sweeps.rules.CLAIMED_BY`), so no reader ever sees it without them.
            max_running, max_live: create only as many as keep the study's RUNNING trials, and its live ones
                (running, waiting, complete, pruned), at or under these; counted under the study's lock, so
                two processes asking at once cannot both take the last slot. The first parameter sets are kept.
        """
        if not params:
            return []
        names = sorted({name for p in params for name in p})
        encoded = {name: distributions.distribution_to_json(dists[name]) for name in names}
        start = datetime.datetime.now()
        start_utc = start.astimezone(datetime.UTC).replace(tzinfo=None)
        with _create_scoped_session(self.scoped_session) as session:
            # The lock Optuna's create_new_trial takes: trial numbers are counted under it.
            models.StudyModel.find_or_raise_by_id(study_id, session, for_update=True)
            try:
                self._check_compatible(session, study_id, {name: dists[name] for name in names})
            except ValueError:
                session.rollback()
                raise
            params = params[:self._room(session, study_id, len(params), max_running, max_live)]
            if not params:
                return []
            ids = []
            for _ in params:  # one INSERT per row: the ids come back on every backend, in order
                result = session.execute(
                    sqlalchemy.insert(_TRIALS).values(
                        study_id=study_id,
                        number=None,
                        state=TrialState.RUNNING,
                        datetime_start=start_utc,
                        datetime_complete=None,
                    )
                )
                ids.append(result.inserted_primary_key[0])  # type: ignore[attr-defined]  # an INSERT's CursorResult
            before = session.execute(
                sqlalchemy.select(sqlalchemy.func.count()).select_from(_TRIALS)
                .where(_TRIALS.c.study_id == study_id, _TRIALS.c.trial_id < ids[0])
            ).scalar_one()
            later = (
                session.execute(
                    sqlalchemy.select(_TRIALS.c.trial_id)
                    .where(_TRIALS.c.study_id == study_id, _TRIALS.c.trial_id >= ids[0])
                    .order_by(_TRIALS.c.trial_id)
                )
                .scalars()
                .all()
            )
            number_of = {trial_id: before + i for i, trial_id in enumerate(later)}
            session.execute(
                sqlalchemy.update(_TRIALS)
                .where(_TRIALS.c.trial_id == sqlalchemy.bindparam("tid"))
                .values(number=sqlalchemy.bindparam("num")),
                [{"tid": trial_id, "num": number_of[trial_id]} for trial_id in ids],
            )
            rows = [{"trial_id": trial_id, "param_name": name, "param_value": dists[name].to_internal_repr(value),
                     "distribution_json": encoded[name]}
                    for trial_id, p in zip(ids, params) for name, value in p.items()]
            if rows:
                session.execute(sqlalchemy.insert(_PARAMS), rows)
            attrs = dict(user_attrs or {})
            if attrs:
                session.execute(
                    sqlalchemy.insert(_USER),
                    [
                        {"trial_id": trial_id, "key": key, "value_json": json.dumps(value)}
                        for trial_id in ids
                        for key, value in attrs.items()
                    ],
                )
        return [
            FrozenTrial(
                number=number_of[trial_id],
                state=TrialState.RUNNING,
                value=None,
                values=None,
                datetime_start=_local(start_utc),
                datetime_complete=None,
                params=dict(p),
                distributions={name: dists[name] for name in p},
                user_attrs=dict(attrs),
                system_attrs={},
                intermediate_values={},
                trial_id=trial_id,
            )
            for trial_id, p in zip(ids, params)
        ]

    @staticmethod
    def _room(session: Any, study_id: int, wanted: int, max_running: Optional[int], max_live: Optional[int]) -> int:
        """How many of `wanted` new RUNNING trials fit under `max_running` and `max_live` (read under the study's
        lock)."""
        room = wanted
        for limit, states in (
            (max_running, [TrialState.RUNNING]),
            (max_live, [TrialState.RUNNING, TrialState.WAITING, TrialState.COMPLETE, TrialState.PRUNED]),
        ):
            if limit is None:
                continue
            have = session.execute(
                sqlalchemy.select(sqlalchemy.func.count()).select_from(_TRIALS)
                .where(_TRIALS.c.study_id == study_id, _TRIALS.c.state.in_(states))
            ).scalar_one()
            room = min(room, limit - have)
        return max(0, room)

    @staticmethod
    def _check_compatible(session: Any, study_id: int, dists: dict[str, distributions.BaseDistribution]) -> None:
        """Each distribution against the study's first stored use of its name, as `set_trial_param` checks it
        (ValueError)."""
        for name, dist in dists.items():
            previous = session.execute(
                sqlalchemy.select(_PARAMS.c.distribution_json).join(_TRIALS, _TRIALS.c.trial_id == _PARAMS.c.trial_id)
                .where(_TRIALS.c.study_id == study_id, _PARAMS.c.param_name == name).limit(1)
            ).scalar()
            if previous is None:
                continue
            stored = distributions.json_to_distribution(previous)
            try:
                distributions.check_distribution_compatibility(stored, dist)
            except ValueError as e:
                raise ValueError(
                    f"parameter {name!r}: the study stores it as {stored}, this batch asks {dist}: {e}"
                ) from e

    def _get_trials(
        self,
        study_id: int,
        states: Container[TrialState] | None,
        included_trial_ids: set[int],
        trial_id_greater_than: int,
    ) -> list[FrozenTrial]:
        included = {i for i in included_trial_ids if i <= trial_id_greater_than}
        where = _TRIALS.c.study_id == study_id
        if states is not None:
            assert isinstance(states, Iterable)
            where = where & _TRIALS.c.state.in_(list(states))
        if included and trial_id_greater_than > -1:
            where = where & sqlalchemy.or_(_TRIALS.c.trial_id.in_(included), _TRIALS.c.trial_id > trial_id_greater_than)
        elif trial_id_greater_than > -1:
            where = where & (_TRIALS.c.trial_id > trial_id_greater_than)
        try:
            with _create_scoped_session(self.scoped_session) as session:
                models.StudyModel.find_or_raise_by_id(study_id, session)
                return self._read(session, where)
        except sqlalchemy.exc.OperationalError:
            # Likely too many variables in the IN list for this database: Optuna's own read has the fallback.
            return super()._get_trials(study_id, states, included_trial_ids, trial_id_greater_than)

    def _read(self, session: Any, where: Any) -> list[FrozenTrial]:
        ids = sqlalchemy.select(_TRIALS.c.trial_id).where(where).scalar_subquery()

        def rows(table: Any, *columns: str, order: str) -> Iterable[Any]:
            query = sqlalchemy.select(table.c.trial_id, *(table.c[c] for c in columns)).where(table.c.trial_id.in_(ids))
            return session.execute(query.order_by(table.c[order])).all()

        trials = session.execute(
            sqlalchemy.select(
                _TRIALS.c.trial_id,
                _TRIALS.c.number,
                _TRIALS.c.state,
                _TRIALS.c.datetime_start,
                _TRIALS.c.datetime_complete,
            )
            .where(where)
            .order_by(_TRIALS.c.trial_id)
        ).all()
        dists: dict[str, Any] = {}
        params: dict[int, dict[str, Any]] = defaultdict(dict)
        param_dists: dict[int, dict[str, Any]] = defaultdict(dict)
        for trial_id, name, value, dist_json in rows(
            _PARAMS, "param_name", "param_value", "distribution_json", order="param_id"
        ):
            dist = dists.get(dist_json)
            if dist is None:
                dist = dists[dist_json] = distributions.json_to_distribution(dist_json)
            params[trial_id][name] = dist.to_external_repr(value)
            param_dists[trial_id][name] = dist
        values: dict[int, dict[int, float]] = defaultdict(dict)
        for trial_id, objective, value, kind in rows(
            _VALUES, "objective", "value", "value_type", order="trial_value_id"
        ):
            values[trial_id][objective] = models.TrialValueModel.stored_repr_to_value(value, kind)
        attrs: dict[str, dict[int, dict[str, Any]]] = {}
        for label, table, order in (
            ("user", _USER, "trial_user_attribute_id"),
            ("system", _SYSTEM, "trial_system_attribute_id"),
        ):
            attrs[label] = defaultdict(dict)
            for trial_id, key, value_json in rows(table, "key", "value_json", order=order):
                attrs[label][trial_id][key] = json.loads(value_json)
        intermediate: dict[int, dict[int, float]] = defaultdict(dict)
        for trial_id, step, value, kind in rows(_INTERMEDIATE, "step", "intermediate_value", "intermediate_value_type",
                                               order="trial_intermediate_value_id"):
            intermediate[trial_id][step] = models.TrialIntermediateValueModel.stored_repr_to_intermediate_value(
                value, kind
            )
        out = []
        for trial_id, number, state, start, complete in trials:
            by_objective = values.get(trial_id)
            out.append(FrozenTrial(
                number=number,
                state=state,
                value=None,
                values=[by_objective[k] for k in range(len(by_objective))] if by_objective else None,
                datetime_start=_local(start),
                datetime_complete=_local(complete),
                params=params.get(trial_id, {}),
                distributions=param_dists.get(trial_id, {}),
                user_attrs=attrs["user"].get(trial_id, {}),
                system_attrs=attrs["system"].get(trial_id, {}),
                intermediate_values=intermediate.get(trial_id, {}),
                trial_id=trial_id,
            ))
        return out


for _name in _WRITES:
    setattr(SweepRDBStorage, _name, _counted(getattr(SweepRDBStorage, _name)))


class SweepCachedStorage(_CachedStorage):
    """Optuna's `_CachedStorage` over a `SweepRDBStorage`, whose `reads_once()` serves repeated reads from one (module
    docstring)."""

    def __init__(self, backend: SweepRDBStorage) -> None:
        super().__init__(backend)
        self._reads = threading.local()

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        del state["_reads"]
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        self._reads = threading.local()

    @contextlib.contextmanager
    def reads_once(self) -> Iterator[None]:
        """Within: this thread's `get_all_trials` reads the database once per write through this process (nests)."""
        if getattr(self._reads, "held", None) is not None:
            yield
            return
        self._reads.held = {}
        try:
            yield
        finally:
            self._reads.held = None

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        held = getattr(self._reads, "held", None)
        if held is None:
            return super().get_all_trials(study_id, deepcopy=deepcopy, states=states)
        backend: SweepRDBStorage = self._backend  # type: ignore[assignment]
        writes = backend.writes  # read first: a write landing during the read below makes the next read go again
        read = held.get(study_id)
        if read is None or read[0] != writes:
            read = held[study_id] = (writes, super().get_all_trials(study_id, deepcopy=False))
        trials = read[1] if states is None else [t for t in read[1] if t.state in states]
        return copy.deepcopy(trials) if deepcopy else list(trials)
