"""An IO manager that keeps each asset's small JSON value in the object store.

Asset values in trainyard are pointers and summaries (URIs, versions,
metrics), never data, so JSON in the object store works the same locally and on
a cluster where steps run in separate pods. Values with a model in
`trainyard.values` are written as their fields and validated when loaded, so a
stored value that does not fit fails naming the asset and the field.
"""

from __future__ import annotations

from typing import Any, Optional

from dagster import AssetKey, ConfigurableIOManager, InputContext, OutputContext

from resources.storage import ObjectStore
from trainyard import naming
from trainyard.values import dump_value, parse_value


class ObjectStoreJsonIOManager(ConfigurableIOManager):
    store: ObjectStore
    prefix: str = naming.IO

    def _uri(self, context: Any) -> str:
        partition = context.asset_partition_key if context.has_asset_partitions else None
        return naming.asset_value_uri(self.store, list(context.asset_key.path), partition, prefix=self.prefix)

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        if obj is None:
            return
        self.store.write_json(self._uri(context), dump_value(obj))

    def write_value(self, asset_key: AssetKey, partition: Optional[str], obj: Any) -> None:
        """Keep `obj` as the value of `asset_key`'s `partition`, where `handle_output` would have put it.

        For a partition an op materializes besides its own (a trial run that
        goes on with the sweep, `assets.sweeps.trial_handover.continue_sweep`).
        """
        self.store.write_json(
            naming.asset_value_uri(self.store, list(asset_key.path), partition, prefix=self.prefix), dump_value(obj)
        )

    def load_input(self, context: InputContext) -> Any:
        """The stored value, as its `trainyard.values` model when it has one.

        Raises:
            FileNotFoundError: Nothing is stored for the asset yet.
            trainyard.values.ValueMismatch: The stored value does not fit its model.
        """
        uri = self._uri(context)
        if not self.store.exists(uri):
            raise FileNotFoundError(
                f"no stored value for {context.asset_key.to_user_string()} at {uri}; materialize it first"
            )
        return parse_value(context.asset_key.path[-1], self.store.read_json(uri), where=uri)
