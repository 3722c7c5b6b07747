"""DCP reading without unpickling arbitrary objects.

torch.distributed.checkpoint reads its ``.metadata`` file with ``pickle.load``
and non-tensor values with ``torch.load(weights_only=False)``: a crafted
checkpoint could run code. Here the metadata is read with an unpickler that
only builds DCP's own metadata dataclasses and a few torch value types, and
non-tensor values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle

from workbench.errors import CheckpointError

_ALLOWED = {
    ("collections", "OrderedDict"), ("builtins", "slice"), ("builtins", "set"), ("builtins", "frozenset"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint"):
            value = super().find_class(module, name)
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def safe_reader(path: str):
    """DCP's storage reader for ``path`` (a local folder or a URL) whose metadata is unpickled safely."""
    from workbench.checkpoint.storage import store_for

    class SafeFileSystemReader(store_for(path).reader_base()):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
                    raise CheckpointError(f"checkpoint metadata in {self.path} is corrupt or unsafe: {exc}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


def referenced_files(path: str) -> set[str]:
    """The files of the DCP checkpoint at ``path``: ``.metadata`` and the shards it refers to."""
    storage = safe_reader(path).read_metadata().storage_data or {}
    return {".metadata"} | {info.relative_path for info in storage.values()}


def safe_planner():
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # the helper DCP itself uses here

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()
