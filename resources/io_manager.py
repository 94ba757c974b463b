"""An IO manager that keeps each asset's small JSON value in the object store.

Asset values in trainyard are pointers and summaries (URIs, versions,
metrics), never data, so JSON in the object store works the same locally and on
a cluster where steps run in separate pods.
"""

from __future__ import annotations

from typing import Any

from dagster import ConfigurableIOManager, InputContext, OutputContext

from resources.storage import ObjectStore


class ObjectStoreJsonIOManager(ConfigurableIOManager):
    store: ObjectStore
    prefix: str = "io"

    def _uri(self, context: Any) -> str:
        parts = list(context.asset_key.path)
        name = context.asset_partition_key if context.has_asset_partitions else "value"
        return self.store.uri(self.prefix, *parts, f"{name}.json")

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        if obj is None:
            return
        self.store.write_json(self._uri(context), obj)

    def load_input(self, context: InputContext) -> Any:
        uri = self._uri(context)
        if not self.store.exists(uri):
            raise FileNotFoundError(f"no stored value for {context.asset_key.to_user_string()} at {uri}; materialize it first")
        return self.store.read_json(uri)
