"""What fedge keeps on disk, and the ground floor every other package stands on.

``files`` (atomic writes, the JSON-lines reader), ``checkpoint`` (the server state of
each round: its writer and its one reader), ``state`` (that server state), ``pixels``
(images as stored, npz files, the input normalization) and ``cards`` (the model card beside
an ONNX file: its writer and its one reader). The coordinator, the devices,
the export and the reports all read and write through here; nothing here imports any
other fedge package.

Importing this package imports nothing heavy: ``fedge-profile infer`` uses ``files``,
``pixels`` and ``cards`` on devices without torch. Only ``checkpoint`` needs torch.
"""

__all__: list[str] = []
