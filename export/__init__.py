"""ONNX export of trained fedge models for the devices that serve them.

``fedge-export`` (:mod:`export.cli`) and the automatic export at the end of a run
(:func:`export.pipeline.export_after_run`) share one path: :mod:`export.source`
reads checkpoints and device state, the methods' export hooks (:mod:`export.hooks`)
prepare the model and assemble devices' personalized ones, :mod:`export.onnx_graph`
exports and checks parity, :mod:`export.card` writes the model card,
:mod:`export.quantize` makes the int8 model. See docs/export.md.

Importing this package imports nothing heavy; onnx and onnxruntime (the ``export``
extra) are needed by the modules that use them.
"""

__all__: list[str] = []
