"""The federation at run time: the round engine and its parts (result intake, broadcast, tasks,
presence, aggregation workers, bookkeeping), the run that drives it, and the in-process simulation.
Configuration, the method registry's coordinator side and the strategies stand beside it in
``coordinator/``; the operations tools in ``coordinator/ops`` and the UI in ``coordinator/ui``."""
