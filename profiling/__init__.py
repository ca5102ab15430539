"""Measuring devices: what a task costs on each one, and the reports people read.

On the device: ``profiler`` (per-task phases, step latencies, memory, CPU), ``sensors``
(temperature, Pi throttling), ``device`` (facts for the hello message), ``history``
(the device's profile.jsonl). For people: ``runs`` (reading run directories and
histories), ``report`` (terminal), ``html`` (HTML with plots), ``infer`` (ONNX Runtime
latency) and ``cli`` (``fedge-profile``). ``schema`` checks a profile received over
the network. It stands on ``storage`` alone (the file helpers and pixels, which need no
torch): nothing here imports the device package, the export or the coordinator.
"""
